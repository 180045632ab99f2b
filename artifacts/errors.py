"""What a stage's command prints when it stops for a reason outside the code: one line that names the cause,
the file, and what to do - not a traceback. Interrupts (Ctrl-C; SIGTERM and SIGHUP, which the stages turn
into one: target/reaper.py), a directory it may not write (permissions, a read-only mount), a full disk,
another process of a distributed job lost (a node that died: its peers' next collective fails). Every other
error keeps its traceback.

    @hydra.main(config_path="../conf", config_name="config", version_base=None)
    @stage_errors("data_prep")
    def main(cfg): run(cfg)
"""

from __future__ import annotations

import errno
import functools
import re
import sys

RESUMES = "rerun the same command: it resumes from what it finished"
# what gloo and NCCL raise in a rank whose peer process is gone (killed, out of memory, its machine lost)
PEER_LOST = re.compile(
    r"Connection closed by peer|Connection reset by peer|remote process exited or there was a network error"
)


def explain(stage: str, error: BaseException, rerun: str = RESUMES) -> str | None:
    """The one line for `error`, or None for an error that keeps its traceback; `rerun`: how the stage
    continues. An interrupt that carries its own message (train's, after its checkpoint) keeps it."""
    if isinstance(error, KeyboardInterrupt):
        return f"{stage}: {error}" if str(error) else f"{stage}: interrupted; {rerun}"
    if isinstance(error, PermissionError) or (isinstance(error, OSError) and error.errno == errno.EROFS):
        return (
            f"{stage}: may not write {error.filename} ({error.strerror}): choose a run_dir (or cache.dir, "
            "export.out_dir, eval.out_dir) this user can write, or fix the permissions or the mount"
        )
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
        where = error.filename or "the directories it writes (run_dir, export.out_dir, eval.out_dir)"
        done = "".join(f"; {note}" for note in getattr(error, "__notes__", ()))  # what the stage freed
        return f"{stage}: no space left on the disk of {where}{done}: free space, then {rerun}"
    if isinstance(error, RuntimeError) and (found := PEER_LOST.search(str(error))):
        return (
            f"{stage}: another process of this distributed job stopped ({found.group(0)}); its own log, on its "
            f"node, says why. Then {rerun} - on every node"
        )
    return None


def stage_errors(stage: str, rerun: str = RESUMES):
    def wrap(main):
        @functools.wraps(main)
        def guarded(*args, **kwargs):
            try:
                return main(*args, **kwargs)
            except (KeyboardInterrupt, OSError, RuntimeError) as error:
                line = explain(stage, error, rerun)
                if line is None:
                    raise
                print(line, file=sys.stderr, flush=True)
                sys.exit(130 if isinstance(error, KeyboardInterrupt) else 1)

        return guarded

    return wrap

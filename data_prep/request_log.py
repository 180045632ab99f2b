"""Per-request logs: each generated turn trained once, with its reasoning.

A server, or a logging proxy in front of one, writes one record per request. An agent loop of N steps is
then N records, and record k re-sends the k-1 earlier turns as history. Clients usually drop
`reasoning_content` from the history they send back. Trained as they are, the earlier turns would be
trained up to N times, and the re-sent ones without the reasoning the target wrote before them.

`merge_requests` keeps each turn once. Records whose messages (reasoning aside) are a prefix of a longer
record's are merged into it, and the turns they logged as their response lend it their reasoning, marked as
sent back without it: data_prep/render.py trains each such turn with its reasoning and renders it without
in the later requests, as the server rendered them (a new sample where that rewrites the history). A log of
whole conversations has no such prefixes and is left as it was. Two records that share a history and then
part (a retried step, a sampled branch) are both kept; the shared turns are trained in the first only
(`weight` 0 in the other, OpenAI's fine-tuning field).
A request logged without its response (`data.unanswered=answer`) is kept for regeneration to answer,
unless another record holds the same messages followed by an answer: then it is merged as a prefix.

Used by data_prep/sources.py (`data.merge_requests`, on by default); the manifest counts what it merged.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace

from artifacts.conversation import Conversation, canonical_json
from data_prep.render import SENT_WITHOUT_REASONING

# what a re-sent turn may lack or differ in
LENT = ("reasoning_content", "weight", "finish_reason", SENT_WITHOUT_REASONING)


def turn_digests(conversation: Conversation) -> tuple[list[tuple[int, str]], list[str], str]:
    """(message index, digest of the conversation up to and including it) per assistant turn: equal for two
    conversations that agree up to that turn, reasoning aside, with the same tools and template kwargs; the
    digests of the conversation up to just before each assistant turn (the questions it answers); and the
    digest of the whole conversation."""
    digest = hashlib.sha256(canonical_json([conversation.tools, conversation.template_kwargs]))
    found, asked = [], []
    for index, message in enumerate(conversation.messages):
        if message["role"] == "assistant":
            asked.append(digest.hexdigest())
        seen = {k: v for k, v in message.items() if k not in LENT}
        seen["content"] = (message["content"] or "").strip()  # a parser's content may differ in spacing
        digest.update(canonical_json(seen) + b"\n")
        if message["role"] == "assistant":
            found.append((index, digest.copy().hexdigest()))
    return found, asked, digest.hexdigest()


def merge_requests(conversations: list[Conversation]) -> tuple[list[Conversation], dict]:
    """The conversations with each assistant turn trained once (in their order), and counts: `merged` (the
    records merged into a longer one), `shared_turns` (turns a kept record shares with an earlier-kept one,
    set to weight 0) and `reasoning_lent` (re-sent turns given the reasoning their own request logged)."""
    messages = [list(c.messages) for c in conversations]
    digests, asked, whole = zip(*map(turn_digests, conversations)) if conversations else ((), (), ())
    answered_elsewhere = {digest for questions in asked for digest in questions}
    owner: dict[str, tuple[int, int]] = {}  # turn digest -> (conversation, message) that trains it
    kept, counts = [], {"merged": 0, "shared_turns": 0, "reasoning_lent": 0}
    # Longest first, so that a loop's last request owns its turns; ties in reading order.
    for i in sorted(range(len(conversations)), key=lambda i: -len(conversations[i].messages)):
        new_turns = 0
        for index, digest in digests[i]:
            if digest not in owner:
                owner[digest], new_turns = (i, index), new_turns + 1
                continue
            j, at = owner[digest]
            response, resent = messages[i][index], messages[j][at]
            if response.get("reasoning_content") and not resent.get("reasoning_content"):
                lent = {"reasoning_content": response["reasoning_content"], SENT_WITHOUT_REASONING: True}
                messages[j][at] = resent = {**resent, **lent}
                counts["reasoning_lent"] += 1
            if response.get("finish_reason") == "length":  # re-sent as cut: it is still no whole turn
                messages[j][at] = {**resent, "finish_reason": "length"}
            messages[i][index] = {**messages[i][index], "weight": 0}
        # a last question no answer follows (data.unanswered=answer) is new unless another record answers it
        open_question = messages[i][-1]["role"] != "assistant" and whole[i] not in answered_elsewhere
        if new_turns or open_question:
            kept.append(i)
            counts["shared_turns"] += len(digests[i]) - new_turns
        else:
            counts["merged"] += 1
    result = [
        conversations[i]
        if messages[i] == conversations[i].messages
        else replace(conversations[i], messages=messages[i])
        for i in sorted(kept)
    ]
    return result, counts

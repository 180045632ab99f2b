"""The EAGLE draft heads and the artifacts the stages share.

data_prep writes, and train / export / eval read, through this package: the typed configs (`config`),
the target loader and its hashes (`target`), the cache manifest (`manifest`), the hidden-state shards
(`cache`), the draft vocabulary map (`vocab`) and the tiny smoke target (`smoke`).
"""

"""The draft heads: every kind, the layers and the one attention they share, the head file, the reference
decoder. See docs/design.md for where each kind's forward, loss and export live."""

"""Dynamic sampling (paper Sec. 3.2): its settings, the producer that fills one rollout step's
batch by rounds of generate, score, shape and filter, the carry-over, the end game, the
per-step statistics reduced over ranks, and this rank's place in the layout."""

"""The robot request class: observations in, timestamped action chunks out (batcher, lanes)."""

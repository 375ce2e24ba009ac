"""Quantify first: the design's measurements (mismatch by route, sparse-attention coverage,
throughput at real lengths) as library functions behind the `launch/` commands."""

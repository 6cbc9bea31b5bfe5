"""Layers that own their weights: format (quant method), tensor-parallel shard, loading."""

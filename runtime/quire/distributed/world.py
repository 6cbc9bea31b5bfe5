"""The world's shape: tensor x pipeline ranks over one or more nodes, and where each rank sits.

Global rank = stage x tp + tensor rank, so a stage's tensor ranks are consecutive; node n
runs ranks [n x k, (n + 1) x k), k = world / nnodes (vLLM's layout: with one stage per node,
a stage's all-reduces never leave its node). Rank 0 is the engine process on node 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from quire import parallel_state as ps
from quire.validation import QuireValidationError


@dataclass(frozen=True)
class World:
    tp: int
    pp: int
    nnodes: int
    layer_counts: tuple[int, ...]  # layers per stage

    @classmethod
    def from_args(cls, args, num_layers: int) -> World:
        """Checks what needs the model: the stages against its layers."""
        pp = args.pipeline_parallel_size
        try:
            counts = ps.partition_layers(num_layers, pp, args.pipeline_layer_partition)
        except ValueError as e:
            name = ("pipeline_layer_partition" if args.pipeline_layer_partition
                    and pp <= num_layers else "pipeline_parallel_size")
            raise QuireValidationError(name, str(e), getattr(args, name)) from None
        return cls(args.tensor_parallel_size, pp, args.nnodes, tuple(counts))

    @property
    def size(self) -> int:
        return self.tp * self.pp

    @property
    def ranks_per_node(self) -> int:
        return self.size // self.nnodes

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def node_ranks(self, node: int) -> range:
        k = self.ranks_per_node
        return range(node * k, (node + 1) * k)

    def local_rank(self, rank: int) -> int:
        """Its index on its node (its GPU there)."""
        return rank % self.ranks_per_node

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def stage(self, rank: int) -> ps.PipelineStage:
        return ps.stage_of(rank // self.tp, list(self.layer_counts))

    def describe(self) -> str:
        stages = ", ".join(f"{s.first_layer}-{s.end_layer - 1}"
                           for s in map(self.stage, range(0, self.size, self.tp)))
        return (f"{self.size} ranks: tensor {self.tp} x pipeline {self.pp} (layers {stages})"
                f"{f' over {self.nnodes} nodes' if self.nnodes > 1 else ''}")

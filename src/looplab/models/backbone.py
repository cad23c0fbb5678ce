"""Backbones: which layer kinds make up the block, the prelude and the coda (docs/formulations.md#backbones).

    llama    every layer an attention layer ("A", models/llama.py)
    mamba2   every layer a Mamba-2 layer ("M", models/mamba2.py)
    hybrid   `hybrid_pattern` (e.g. "MMMA") tiled over the layers

A backbone names a pattern of layer kinds; a layer kind is a registered module class keyed by its letter
(models/registry.py LAYERS), which declares its cache entry and what it supports. A researcher's block layer is
a new letter and a backbone that uses it (docs/extending.md#a-backbone-block).
"""

from __future__ import annotations

from looplab.models.registry import BACKBONES, LAYERS, ConfigError, Supports, Variant


class Backbone(Variant):
    """The layer kinds of n layers (one letter each); what they support is their layer classes' and what the
    backbone itself declares (`supports`: what its pattern changes; export and parallel loops only where it says so)."""

    @classmethod
    def layer_kinds(cls, config, n: int) -> str:
        raise NotImplementedError

    @classmethod
    def validate(cls, config) -> None:
        """Refuse, naming the field, what this backbone cannot build (its layers validate their own widths)."""


@BACKBONES.register("llama")
class Llama(Backbone):
    supports = Supports(parallel_loops=True, export=True)

    @classmethod
    def layer_kinds(cls, config, n):
        return "A" * n


@BACKBONES.register("mamba2")
class Mamba2(Backbone):
    supports = Supports(parallel_loops=True, export=True)

    @classmethod
    def layer_kinds(cls, config, n):
        return "M" * n


@BACKBONES.register("hybrid")
class Hybrid(Backbone):
    supports = Supports(parallel_loops=True, export="the exported code builds every layer as an attention layer and "
                                                     "reads no hybrid_pattern")
    @classmethod
    def layer_kinds(cls, config, n):
        pat = config.hybrid_pattern or "M"
        return "".join(pat[i % len(pat)] for i in range(n))

    @classmethod
    def validate(cls, config):
        pat = config.hybrid_pattern
        known = LAYERS.names()
        if not isinstance(pat, str) or not pat or any(c not in LAYERS for c in pat):
            raise ConfigError(f"hybrid_pattern={pat!r} must be a non-empty string of layer letters "
                              f"({', '.join(f'{k!r} {LAYERS.get(k).title}' for k in known)})")


class Layer(Variant):
    """What a block layer class declares beside being an nn.Module taking (x, positions, valid, cache): its pattern
    letter `kind`, a `title` for messages, `supports` (its cache entry: "kv" or "ssm"), `validate(config)` and
    `allocate_cache(batch, max_len, device, dtype)`."""

    kind: str = ""
    title: str = ""

    @classmethod
    def validate(cls, config) -> None:
        """Refuse, naming the field, a width this layer cannot take."""


def build_layer(kind: str, config):
    """One block (or prelude, coda) layer of kind `kind` (a LAYERS letter)."""
    return LAYERS.get(kind)(config)

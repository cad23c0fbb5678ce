"""Serving many requests: `Engine` keeps a running batch (continuous batching), `solo_agreement` checks it
against decoding each request alone (docs/decoding.md#serving-many-requests)."""

from looplab.serve.engine import TIE_MARGIN, Engine, Request, solo_agreement

__all__ = ["TIE_MARGIN", "Engine", "Request", "solo_agreement"]

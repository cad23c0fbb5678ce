"""`looplab.eval.LooplabLM`: the lm-evaluation-harness adapter (docs/evaluation.md#lm-eval-adapter).

Registered with lm-eval as model `looplab` when `looplab.eval` is imported:

    lm_eval --model looplab --model_args checkpoint=PATH,batch_size=16,device=cuda --tasks piqa
    (generation tasks: speculative_loops=k,draft_tokens=γ decode greedily by self-speculation, same text)
    lm_eval.simple_evaluate(model="looplab", model_args="checkpoint=PATH", tasks=[...])

The tokenizer is rebuilt from the dataset config stored in the checkpoint
(`meta["dataset"]["tokenizer"]`), so a checkpoint evaluates with the tokens it
was trained on.

Scoring. A request (context, continuation) is tokenised the way lm-eval's own
models do it: trailing whitespace of the context moves to the continuation
(BPE vocabularies attach a space to the word after it, " world"), the
continuation's tokens are those of encode(context + continuation) after the
first len(encode(context)) tokens, and the model is fed encode(context) +
those tokens. An empty context is replaced by the EOS token (documents in
training are separated by EOS, so it is the natural start). Sequences are
right-padded in a batch; the model is causal, so padding after a token never
changes that token's logits. Sequences longer than max_length keep their last
max_length + 1 tokens.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from looplab.data.tokenizer import LMTokenizer, load_tokenizer
from looplab.models.exits import ExitPolicy
from looplab.models.generation import Speculation, check_options

log = logging.getLogger(__name__)


def _as_int(x: Any, default: int) -> int:
    if x is None:
        return default
    if isinstance(x, str):
        if x.startswith("auto"):  # lm-eval's automatic batch size search is not implemented here
            log.warning("batch_size=%r: automatic batch size is not supported by looplab; using %d", x, default)
            return default
        return int(x)
    return int(x)


@register_model("looplab")
class LooplabLM(LM):
    def __init__(
        self,
        checkpoint: str | None = None,
        batch_size: int | str = 8,
        device: str | None = None,
        max_length: int | None = None,
        exit_threshold: float | None = None,
        exit_rule: str | None = None,
        exit_min_loops: int = 1,
        n_loops: int | None = None,
        speculative_loops: int | None = None,
        draft_tokens: int | str = 4,
        max_gen_toks: int = 256,
        tokenizer: str | LMTokenizer | None = None,
        model: torch.nn.Module | None = None,
        dtype: str | None = None,
        **kwargs: Any,  # lm-eval passes max_batch_size and other harness-wide options
    ):
        super().__init__()
        if kwargs:
            log.info("LooplabLM ignores model_args %s", sorted(kwargs))
        meta: dict[str, Any] = {}
        if model is None:
            if checkpoint is None:
                raise ValueError("LooplabLM needs model_args checkpoint=PATH (or an in-memory model via LooplabLM.from_model)")
            from looplab.checkpoint import load_model

            model, meta = load_model(checkpoint)
        dataset_cfg = meta.get("dataset") or {}
        if tokenizer is None:
            if not dataset_cfg.get("tokenizer"):
                raise ValueError(
                    f"checkpoint {checkpoint!r} was trained on dataset {dataset_cfg.get('name', '?')!r}, which has no text "
                    "tokenizer; zero-shot text tasks need a language-model checkpoint (or pass tokenizer=SPEC)"
                )
            tokenizer = load_tokenizer(dataset_cfg)
        self.tok = tokenizer if isinstance(tokenizer, LMTokenizer) else load_tokenizer(tokenizer)
        if self.tok.vocab_size > model.config.vocab_size:
            raise ValueError(f"tokenizer {self.tok.spec!r} has {self.tok.vocab_size} tokens but the model only {model.config.vocab_size}")

        self._device = torch.device(device) if device else next(model.parameters()).device
        self.model = model.to(self._device)
        if dtype is not None:
            self.model = self.model.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype)
        self.model.eval()
        self.batch_size = max(1, _as_int(batch_size, 8))
        trained_len = dataset_cfg.get("seq_len")
        want = int(max_length) if max_length is not None else int(trained_len or model.config.max_seq_len)
        if want > model.config.max_seq_len:
            log.warning("max_length=%d exceeds the model's max_seq_len=%d (RoPE table); using %d", want, model.config.max_seq_len, model.config.max_seq_len)
        self._max_length = min(want, model.config.max_seq_len)
        self.exit_threshold = float(exit_threshold) if exit_threshold is not None else None
        self.exit_rule, self.exit_min_loops = exit_rule or None, _as_int(exit_min_loops, 1)
        # test-time depth R′: every forward pass and generation applies the shared block R′ times
        self.n_loops = None if n_loops in (None, "", "None") else _as_int(n_loops, 0)
        if self.n_loops is not None and self.n_loops < 1:
            raise ValueError(f"n_loops must be ≥ 1, got {n_loops!r}")
        depth = self.n_loops or model.config.n_loops
        self.exits = ExitPolicy.from_kwargs(self.exit_threshold, self.exit_rule, self.exit_min_loops)
        # self-speculative greedy generation: same text, generate_until only
        self.speculative_loops = None if speculative_loops in (None, "", "None") else _as_int(speculative_loops, 0)
        self.draft_tokens = draft_tokens if draft_tokens == "auto" else _as_int(draft_tokens, 4)
        self.speculation = None if self.speculative_loops is None else Speculation(self.speculative_loops, self.draft_tokens)
        if self.exits is not None:
            self.exits.check(model, depth)  # scoring reads out at the exits too, not only generation
        try:
            check_options(model, depth, exits=self.exits, speculation=self.speculation)
        except ValueError as e:  # name the model_args key the user typed
            raise ValueError(f"model_args speculative_loops={self.speculative_loops}, draft_tokens={self.draft_tokens}, "
                             f"exit_threshold={self.exit_threshold}: {e}") from e
        self.max_gen_toks = int(max_gen_toks)
        self.checkpoint = checkpoint

    @classmethod
    def from_model(cls, model: torch.nn.Module, tokenizer: str | LMTokenizer, **kwargs: Any) -> "LooplabLM":
        """Wrap an in-memory LoopedLM (tests, notebooks, evaluation inside a training run)."""
        return cls(model=model, tokenizer=tokenizer, **kwargs)

    # ------------------------------------------------------------ lm-eval API
    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return self.tok.spec.replace("/", "__")

    def tok_encode(self, text: str) -> list[int]:
        return self.tok.encode(text)

    def tok_decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(ids)

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        n_space = len(context) - len(context.rstrip())
        if n_space:
            context, continuation = context[:-n_space], context[-n_space:] + continuation
        if context == "":
            return [self.eot_token_id], self.tok.encode(continuation)
        whole = self.tok.encode(context + continuation)
        ctx = self.tok.encode(context)
        return ctx, whole[len(ctx):]

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        items = []
        for req in requests:
            ctx, cont = self.encode_pair(*req.args)
            if not cont:
                raise ValueError(f"continuation {req.args[1]!r} encodes to no tokens after context {req.args[0][-40:]!r}")
            items.append((ctx + cont, len(cont)))
        results = self._score(items)
        for req, res in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", req.args, res)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Disjoint windows of max_length predictions; each token is predicted once with as much
        context as fits (the last window reaches back a full max_length)."""
        L = self.max_length
        items, owner = [], []
        for k, req in enumerate(requests):
            seq = [self.eot_token_id] + self.tok.encode(req.args[0])
            n = len(seq) - 1  # tokens to predict: seq[1:]
            for a in range(1, n + 1, L):
                b = min(a + L, n + 1)  # targets seq[a:b]
                s = max(0, b - 1 - L)  # input seq[s:b-1]
                items.append((seq[s:b], b - a))
                owner.append(k)
        totals = [0.0] * len(requests)
        for k, (lp, _) in zip(owner, self._score(items)):
            totals[k] += lp
        for req, t in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, t)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        for key, idx in groups.items():
            kw = dict(requests[idx[0]].args[1] or {})
            until = kw.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            n_new = min(int(kw.get("max_gen_toks", self.max_gen_toks)), self.max_length - 1)
            for c in range(0, len(idx), self.batch_size):
                chunk = idx[c : c + self.batch_size]
                prompts = [self._truncate_prompt(self.tok.encode(requests[i].args[0]) or [self.eot_token_id], n_new) for i in chunk]
                for i, new in zip(chunk, self._greedy(prompts, n_new)):
                    text = self.tok.decode(new)
                    for stop in until + [self.tok.eos_token]:
                        if stop and stop in text:
                            text = text[: text.index(stop)]
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out  # type: ignore[return-value]

    # -------------------------------------------------------------- internals
    def _exit_kwargs(self) -> dict[str, Any]:
        """The depth and exit policy every forward pass and generation of this adapter uses (none: loop R)."""
        kw: dict[str, Any] = {} if self.n_loops is None else {"n_loops": self.n_loops}
        if self.exits is not None:
            kw["exits"] = self.exits
        return kw

    def _forward_logits(self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        kw = self._exit_kwargs()
        if attention_mask is not None:
            kw["attention_mask"] = attention_mask
        return self.model(ids, **kw).logits

    @torch.no_grad()
    def _score(self, items: list[tuple[list[int], int]]) -> list[tuple[float, bool]]:
        """items: (tokens, n) → (Σ log p of the last n tokens given the ones before, all n greedy?)."""
        L = self.max_length
        prepared = []
        for tokens, n in items:
            tokens = tokens[-(L + 1):]
            prepared.append((tokens[:-1], tokens[1:], min(n, len(tokens) - 1)))
        order = sorted(range(len(prepared)), key=lambda i: -len(prepared[i][0]))  # similar lengths share a batch
        results: list[tuple[float, bool] | None] = [None] * len(prepared)
        for c in range(0, len(order), self.batch_size):
            chunk = order[c : c + self.batch_size]
            T = max(len(prepared[i][0]) for i in chunk)
            ids = torch.full((len(chunk), T), self.eot_token_id, dtype=torch.long)
            for row, i in enumerate(chunk):
                inp = prepared[i][0]
                ids[row, : len(inp)] = torch.tensor(inp, dtype=torch.long)
            logp = F.log_softmax(self._forward_logits(ids.to(self._device)).float(), dim=-1)
            for row, i in enumerate(chunk):
                inp, tgt, n = prepared[i]
                lp = logp[row, len(inp) - n : len(inp)]  # (n, V)
                want = torch.tensor(tgt[-n:], dtype=torch.long, device=lp.device)
                score = lp.gather(-1, want[:, None]).sum().item()
                greedy = bool((lp.argmax(-1) == want).all())
                results[i] = (score, greedy)
        return results  # type: ignore[return-value]

    def _truncate_prompt(self, ids: list[int], n_new: int) -> list[int]:
        keep = max(1, self.max_length - n_new)
        return ids[-keep:]

    @torch.no_grad()
    def _greedy(self, prompts: list[list[int]], n_new: int) -> list[list[int]]:
        """Left-padded batch → new tokens per row (cut after the first EOS)."""
        B, T = len(prompts), max(len(p) for p in prompts)
        ids = torch.full((B, T), self.eot_token_id, dtype=torch.long)
        mask = torch.zeros((B, T), dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, T - len(p):] = torch.tensor(p)
            mask[r, T - len(p):] = 1
        ids, mask = ids.to(self._device), mask.to(self._device)
        try:
            kw = self._exit_kwargs()
            if self.speculation is not None:
                kw["speculation"] = self.speculation
            seq = self.model.generate(ids, n_new, eos_token_id=self.eot_token_id,
                                      attention_mask=mask if not bool(mask.all()) else None, **kw)
            new = seq[:, T:]
        except (ImportError, AttributeError):  # no cached decoder available: recompute the prefix each step
            steps = []
            for _ in range(n_new):
                nxt = self._forward_logits(ids, mask if not bool(mask.all()) else None)[:, -1].argmax(-1)
                steps.append(nxt)
                ids = torch.cat([ids, nxt[:, None]], 1)
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
                if bool((torch.stack(steps, 1) == self.eot_token_id).any(1).all()):
                    break
            new = torch.stack(steps, 1) if steps else ids[:, :0]
        rows = []
        for r in range(B):
            toks = new[r].tolist()
            if self.eot_token_id in toks:
                toks = toks[: toks.index(self.eot_token_id)]
            rows.append(toks)
        return rows

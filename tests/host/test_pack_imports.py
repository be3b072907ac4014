"""The pack takes no top-level import name from other packages.

A ComfyUI process runs every pack in one interpreter, so a pack whose folders shadow an installed
package breaks the others (Hugging Face's `kernels`, which transformers probes for, is one such name).
The check runs in a fresh interpreter where a package called `kernels` is installed ahead of the pack,
loads the pack through ComfyUI's own loader and samples a Carnator attention call.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from support.comfy_host import REPO_ROOT

SCRIPT = textwrap.dedent("""
    import sys
    from pathlib import Path
    site, tests, comfy_path, base = sys.argv[1:5]
    sys.path[:0] = [site, tests]
    from support.comfy_host import InProcessComfy, make_base_dir

    comfy = InProcessComfy(Path(comfy_path), make_base_dir(Path(base)))
    assert any(node.startswith("Carnator") for node in comfy.pack_node_ids("carnator")), "pack not loaded"

    import kernels
    assert kernels.ORIGIN == "installed", kernels.__file__

    import torch
    from carnator_core.kernels import BlockLayout, block_sparse_attention, reference_attention
    q, k, v = (torch.randn(1, 2, 128, 64) for _ in range(3))
    layout = BlockLayout.from_dense(torch.tensor([[[[True, False], [True, True]]]]), block_size=64, n_tokens=128)
    assert torch.allclose(block_sparse_attention(q, k, v, layout), reference_attention(q, k, v, layout), atol=1e-4)
    print("ok", kernels.__file__)
""")


def test_installed_kernels_package_imports_as_itself_with_the_pack_loaded(comfyui_path: Path, tmp_path: Path):
    site = tmp_path / "site-packages"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text('ORIGIN = "installed"\n')
    (tmp_path / "base").mkdir()
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(site), str(REPO_ROOT / "tests"), str(comfyui_path), str(tmp_path / "base")],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().splitlines()[-1] == f"ok {site / 'kernels' / '__init__.py'}"

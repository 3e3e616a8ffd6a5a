"""`import strata.torch` before or after `import torch` (issue 49): the native
module links CUDA's runtime and NCCL from the toolkit it was built with, and a
CUDA build of torch (PyPI's) loads its own copies; a second copy of a library
torch also loads broke torch ("undefined symbol: ncclCommResume"). In either
order one copy of each is mapped, and both torch and strata work."""
import ast
import subprocess
import sys

import pytest

PROBE = r"""
import re
{imports}
maps = open("/proc/self/maps").read()
copies = {{}}
for path in set(re.findall(r"(/\S*/lib(?:nccl|cudart)\.so[.\d]*)$", maps, re.M)):
    copies.setdefault(re.sub(r"\.so.*", "", path.rsplit("/", 1)[1]), []).append(path)
assert torch.ones(3).sum().item() == 3.0
opt = strata.optim.CPUAdam([torch.nn.Parameter(torch.ones(4))], lr=0.1)
print(sorted(copies.items()))
"""


@pytest.mark.parametrize("imports", ["import strata.torch, strata\nimport torch",
                                     "import torch\nimport strata.torch, strata"], ids=["strata-first", "torch-first"])
def test_either_import_order_maps_one_copy_of_cuda_and_nccl(imports):
    done = subprocess.run([sys.executable, "-c", PROBE.format(imports=imports)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    copies = ast.literal_eval(done.stdout.strip().splitlines()[-1])  # [(library, [paths])]
    for library, paths in copies:
        assert len(paths) == 1, (library, paths)

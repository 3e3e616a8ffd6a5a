#!/usr/bin/env bash
# The peer's wheel set for the GPU machine (issue 50 §2 item 3, §4;
# docs/gpu-results.md "The peer (DeepSpeed) on the GPU machine").
#
#   scripts/gpu-peer-wheels.sh [--dir DIR]            # assemble (default DIR .gpu-pack/peer-wheels)
#   scripts/gpu-peer-wheels.sh [--dir DIR] --check    # then prove it installs offline into a clean cp312 venv
#
# The GPU machine has Python 3.12 with torch 2.11, numpy, einops, msgpack,
# ninja, packaging, psutil, py-cpuinfo and tqdm, and no network. DeepSpeed
# needs, beyond those, hjson and pydantic (with pydantic-core, a compiled
# cp312 wheel, annotated-types, typing-inspection and typing-extensions,
# which is carried because the machine's version is not known). DeepSpeed
# itself is built here into a py3-none-any wheel with DS_BUILD_OPS=0: its
# ops are compiled by its JIT on the GPU machine, against that machine's
# torch and nvcc. Everything is pinned; a wheel already in DIR at its pinned
# version is reused, and a wheel of any other version is removed (two
# versions of one package stop an install).
#
# Environment: STRATA_PEER_BUILD_PYTHON, a Python with torch to build
# DeepSpeed's wheel (default build/python/venv-torch2/bin/python, else
# /usr/bin/python3); STRATA_PEER_CHECK_PYTHON, the clean Python 3.12 for
# --check (default the newest pyenv 3.12).
set -euo pipefail
cd "$(dirname "$0")/.."

deepspeed_version=0.19.8
# DeepSpeed's requirements that the GPU machine lacks, and theirs, as
# name==version (the version pydantic 2.14.4 pins pydantic-core to).
downloaded_pins=(hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
                 typing-inspection==0.4.5 typing-extensions==4.16.0)
# What the GPU machine already has of DeepSpeed's requirements (KINDS.md's
# package list). --check installs these from PyPI into the stand-in for it.
machine_has=(einops msgpack ninja numpy packaging psutil py-cpuinfo tqdm)
limit_mib=48  # the 64 MiB a call carries, less room for Strata's own pack

dir=.gpu-pack/peer-wheels
check=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dir) [[ $# -ge 2 ]] || { echo "gpu-peer-wheels.sh: --dir needs a folder" >&2; exit 2; }; dir="$2"; shift 2 ;;
    --check) check=1; shift ;;
    -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
    *) echo "gpu-peer-wheels.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)

# A wheel's file name starts with its name (dashes and dots as underscores)
# and version: "pydantic_core-2.50.5-cp312-...".
wheel_prefix() { local name="${1%%==*}" version="${1##*==}"; echo "${name//[-.]/_}-$version-"; }
has_wheel() { compgen -G "$dir/$(wheel_prefix "$1")*.whl" > /dev/null; }

# 1. Wheels of other versions (or other packages) than the pins go.
wanted=("deepspeed==$deepspeed_version" "${downloaded_pins[@]}")
for wheel in "$dir"/*.whl; do
  [[ -e "$wheel" ]] || continue
  keep=0
  for pin in "${wanted[@]}"; do [[ $(basename "$wheel") == "$(wheel_prefix "$pin")"* ]] && keep=1; done
  [[ $keep == 1 ]] || { echo "== removing $(basename "$wheel") (not a pinned version)"; rm -f "$wheel"; }
done

# 2. DeepSpeed, built here. Its setup.py imports torch, hence no build
#    isolation and a Python that has torch.
if has_wheel "deepspeed==$deepspeed_version"; then
  echo "== deepspeed $deepspeed_version: already in $dir"
else
  build_python="${STRATA_PEER_BUILD_PYTHON:-}"
  if [[ -z "$build_python" ]]; then
    build_python=/usr/bin/python3
    [[ -x build/python/venv-torch2/bin/python ]] && build_python=build/python/venv-torch2/bin/python
  fi
  if ! "$build_python" -c 'import torch' 2> /dev/null; then
    echo "gpu-peer-wheels.sh: $build_python cannot import torch, which DeepSpeed's setup.py needs;" \
         "set STRATA_PEER_BUILD_PYTHON to a Python that has torch" >&2
    exit 1
  fi
  echo "== building deepspeed $deepspeed_version with $build_python (DS_BUILD_OPS=0: ops left to its JIT)"
  DS_BUILD_OPS=0 "$build_python" -m pip wheel -q --no-deps --no-build-isolation -w "$dir" \
    "deepspeed==$deepspeed_version"
  has_wheel "deepspeed==$deepspeed_version" ||
    { echo "gpu-peer-wheels.sh: pip built no deepspeed-$deepspeed_version wheel in $dir" >&2; exit 1; }
fi

# 3. The dependencies, as cp312 manylinux x86_64 or pure-Python wheels.
missing=()
for pin in "${downloaded_pins[@]}"; do has_wheel "$pin" || missing+=("$pin"); done
if [[ ${#missing[@]} -eq 0 ]]; then
  echo "== dependencies: all ${#downloaded_pins[@]} pinned wheels already in $dir"
else
  echo "== downloading ${missing[*]}"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dir" "${missing[@]}"
  for pin in "${missing[@]}"; do
    has_wheel "$pin" || { echo "gpu-peer-wheels.sh: pip downloaded no wheel for $pin into $dir" >&2; exit 1; }
  done
fi

# 4. The size, against what a call can carry.
bytes=$(du -cb "$dir"/*.whl | tail -1 | cut -f1)
mib=$(awk -v b="$bytes" 'BEGIN { printf "%.1f", b / 1048576 }')
echo "== $dir: $(ls "$dir"/*.whl | wc -l) wheels, $mib MiB"
ls -1 "$dir"/*.whl | sed 's|.*/|   |'
if ((bytes > limit_mib * 1048576)); then
  echo "gpu-peer-wheels.sh: the wheel set is $mib MiB, over the $limit_mib MiB a call can spare beside Strata's pack" >&2
  exit 1
fi
[[ $check == 1 ]] || exit 0

# 5. --check: a clean cp312 venv standing in for the GPU machine (its
#    packages from PyPI, torch as metadata only), and a second venv over it,
#    as gpu-check.sh makes one over the machine's Python, into which the
#    wheel set installs with no index.
check_python="${STRATA_PEER_CHECK_PYTHON:-}"
if [[ -z "$check_python" ]]; then
  check_python=$(ls -d "$HOME"/.pyenv/versions/3.12*/bin/python3.12 2> /dev/null | sort -V | tail -1)
fi
if [[ -z "$check_python" ]] || ! "$check_python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
  echo "gpu-peer-wheels.sh: --check needs a Python 3.12 (found '${check_python:-none}');" \
       "set STRATA_PEER_CHECK_PYTHON" >&2
  exit 1
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "== check with $check_python ($("$check_python" --version)) in $work"
"$check_python" -m venv "$work/machine"
"$work/machine/bin/python" -m pip install -q "${machine_has[@]}"
machine_site=$("$work/machine/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# torch 2.11 as the machine has it, as far as pip can see: metadata, no code.
mkdir -p "$machine_site/torch-2.11.0.dist-info"
printf 'Metadata-Version: 2.1\nName: torch\nVersion: 2.11.0\n' > "$machine_site/torch-2.11.0.dist-info/METADATA"
printf 'pip\n' > "$machine_site/torch-2.11.0.dist-info/INSTALLER"
: > "$machine_site/torch-2.11.0.dist-info/RECORD"

# The peer venv over it, made by the script gpu-check.sh runs on the machine.
failures=0
fail() { echo "CHECK FAILED: $*" >&2; failures=$((failures + 1)); }
if scripts/gpu-peer-venv.sh "$work/machine/bin/python" "$dir" "$work/peer" > "$work/install.log" 2>&1; then
  echo "ok: deepspeed $deepspeed_version and its requirements installed with no index ($(tail -1 "$work/install.log"))"
else
  fail "scripts/gpu-peer-venv.sh: $(tail -3 "$work/install.log")"
fi
peer_site=$("$work/peer/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# Every requirement of deepspeed's METADATA (extras aside) is met, torch by
# the stand-in, the rest by the machine's packages or the wheel set.
"$work/peer/bin/python" - "$peer_site" << 'EOF' || fail "a requirement of deepspeed is not met (above)"
import importlib.metadata as md, sys
from packaging.requirements import Requirement
requirements = [Requirement(r) for r in md.requires("deepspeed") or [] if "extra ==" not in r]
bad = 0
for requirement in requirements:
    try:
        version = md.version(requirement.name)
    except md.PackageNotFoundError:
        print("missing:", requirement); bad += 1; continue
    where = "wheel set" if md.distribution(requirement.name).locate_file("").as_posix().startswith(sys.argv[1]) else "machine"
    ok = requirement.specifier.contains(version, prereleases=True)
    print("ok:" if ok else "unmet:", requirement, "->", requirement.name, version, "from the", where)
    bad += not ok
sys.exit(bad)
EOF
pip_check=$("$work/machine/bin/python" -m pip --python "$work/peer/bin/python" check 2>&1) || true
echo "pip check: $pip_check"
grep -v -i -e torch -e 'No broken requirements' <<< "$pip_check" | grep -q . && fail "pip check names more than torch"
# What imports without torch: the carried packages, and DeepSpeed's own
# torch-free module (its version file).
"$work/peer/bin/python" -c '
import hjson, pydantic, pydantic_core, annotated_types, typing_inspection, typing_extensions
from pydantic import BaseModel
class Probe(BaseModel):
    stage: int
assert Probe(stage="3").stage == 3 and hjson.loads("{a: 1}") == {"a": 1}
import importlib.util, pathlib
spec = importlib.util.find_spec("deepspeed")
assert spec is not None, "deepspeed is not importable"
version_file = pathlib.Path(spec.origin).parent / "git_version_info_installed.py"
namespace = {}; exec(version_file.read_text(), namespace)
assert namespace["version"] == "'"$deepspeed_version"'", namespace["version"]
assert not any(namespace["installed_ops"].values()), namespace["installed_ops"]
print("ok: pydantic", pydantic.VERSION, "validates; hjson parses; deepspeed", namespace["version"],
      "is on the path with no prebuilt op (all left to the JIT)")' || fail "an import without torch"
if [[ $failures -ne 0 ]]; then
  echo "gpu-peer-wheels.sh --check: $failures check(s) failed" >&2
  exit 1
fi
echo "gpu-peer-wheels.sh --check: the wheel set installs offline into a clean cp312 venv; only the GPU machine can import deepspeed (it needs torch)"

#!/usr/bin/env bash
# FlashAttention-4 (flash-attn-4 and its CuTe DSL wheels, ~100 MB for Python 3.12) for a GPU machine without network
# access that takes at most 64 MiB of carried files per call, so `flashtriton bench --providers ...,fa4` can run there.
#
#   bash tools/fa4_wheels.sh fetch     # here (pip reaches the index): the wheels into .fa4/, split in two halves:
#                                      # .fa4/a (the first half of the 92 MB nvidia-cutlass-dsl-libs-cu13 wheel) and
#                                      # .fa4/b (its second half and the other wheels), each under 64 MiB
#   bash tools/fa4_wheels.sh install   # there, once both halves arrived: the wheel put together again, everything
#                                      # installed into /tmp/fa4 (pip --target, no dependency resolution); then
#                                      # PYTHONPATH=$(bash tools/fa4_wheels.sh path):$PYTHONPATH
#                                      # python -m flashtriton bench --providers flashtriton,sdpa-flash,sdpa-cudnn,fa4
#   bash tools/fa4_wheels.sh path      # the PYTHONPATH entries of that install: /tmp/fa4 and its
#                                      # nvidia_cutlass_dsl/dsl_packages (what nvidia-cutlass-dsl's .pth file would
#                                      # add; --target directories get no .pth processing)
#
#   bash tools/fa4_wheels.sh stash     # there, in the call that carried .fa4/a: its half into /tmp/fa4-parts
#
# Two calls on the same GPU machine, one after the other (it keeps /tmp between them): the first carries .fa4/a and
# runs stash, the second carries .fa4/b and runs install.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="$root/.fa4"
stash=/tmp/fa4-parts
site=/tmp/fa4
site_path="$site:$site/nvidia_cutlass_dsl/dsl_packages"
big="nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl"
wheels=(flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1
        nvidia-cutlass-dsl-libs-cu13==4.8.1 apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5
        quack-kernels==0.6.5 nvidia-cutlass-dsl-libs-core==4.8.1)

case "${1:-}" in
  fetch)
    mkdir -p "$dir/download" "$dir/a" "$dir/b"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dir/download" "${wheels[@]}"
    half=$(( $(stat -c %s "$dir/download/$big") / 2 + 1 ))
    split -b "$half" -d -a 1 "$dir/download/$big" "$dir/part"
    mv "$dir/part0" "$dir/a/$big.part0"
    mv "$dir/part1" "$dir/b/$big.part1"
    find "$dir/download" -name '*.whl' ! -name "$big" -exec cp {} "$dir/b/" \;
    du -sh "$dir/a" "$dir/b"
    ;;
  stash)
    mkdir -p "$stash"
    cp "$dir/a/$big.part0" "$stash/"
    ;;
  install)
    test -f "$stash/$big.part0" || { echo "no $stash/$big.part0: run stash in the call before (same machine)"; exit 1; }
    work="$(mktemp -d)"
    cat "$stash/$big.part0" "$dir/b/$big.part1" > "$work/$big"
    cp "$dir"/b/*.whl "$work/"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$work"/*.whl
    PYTHONPATH="$site_path${PYTHONPATH:+:$PYTHONPATH}" \
      python3 -c "import flash_attn.cute; print('flash_attn.cute from', flash_attn.cute.__file__)"
    ;;
  path)
    echo "$site_path"
    ;;
  *)
    sed -n '2,19p' "${BASH_SOURCE[0]}"
    exit 2
    ;;
esac

#!/usr/bin/env bash
# The device calls sessions 60-77 prepared for the next one (benchmarks/NOTES.md items 75-92), kept here because
# .device-data/ and unmerged branches do not outlive a checkout. From the repository root:
#   here:    bash benchmarks/raw/s63-next-calls.sh prep     # variant trees under .device-data/ (carry the
#            .device-data/var-NAME trees a call runs: all of them pass the 64 MiB a call may carry)
#   device:  bash benchmarks/raw/s63-next-calls.sh suite | figures | streamv3 | somodel | kbfp8 | prefetch2 |
#            mlasplits | tiles256 | profile256 | v3slots | rowsplit | profiles | rotary | slots12 | projections |
#            combo | prefetch | weightfirst
#            (streamv3: the streamed output at V2-Lite b=256, 32 and V3's fp8 b=1, 8, then so3model if V3 gains;
#            streamout adds b=128, 64 and its GPU twins; with little device time streamlean (b=256 and V3 b=1)
#            or sosm (V2-Lite's half of streamv3, then somodel))
#            (in that order of worth; suite and figures on an H200 (neither has run on one since item 82: the
#            act_quant, router, output128 and tile prologue merges of items 84, 85, 87 and 89 are untimed there);
#            prefetch2 on an H200 (item 85: no gain on an H100); weightfirst: item 72 measured the same order as no
#            gain. Done: tpsuite, order, ordmodel (item 89), smmodel (item 90). Dropped: walkmodel (item 89),
#            orddown and the grid-order trees ord, sm, walk (item 90: tile-major swiglu launches lose in the model;
#            the launches alone, which `bench_grouped_decode.py` times, are not the model's))
# Results under $OUT/r, also tarred as $OUT/r.tgz (a call returns at most 8 files).
set -u
cd "$(dirname "$0")/../.."
R=${OUT:-/tmp/out}/r
mkdir -p "$R"
export XLA_PYTHON_CLIENT_PREALLOCATE=false

tree() {  # NAME [PATCH [PATH...]]: HEAD's code (no assets, tests or docs; PATHs too) in .device-data/var-NAME,
  # with PATCH applied
  rm -rf ".device-data/var-$1" && mkdir -p ".device-data/var-$1"
  git archive HEAD -- dsv3_jax pallas_kernels scripts configs pyproject.toml ':(exclude)dsv3_jax/assets' "${@:3}" \
    | tar -x -C ".device-data/var-$1"
  [ -z "${2:-}" ] || patch -s -p1 -d ".device-data/var-$1" < "$2"
}

in_tree() {  # NAME COMMAND...: run in a variant tree, its output kept in $R/log
  local name=$1; shift
  echo "== $name: $*" | tee -a "$R/log"
  (cd ".device-data/var-$name" && PYTHONPATH=. timeout "${LIMIT:-240}" "$@" 2>&1 | grep -v Warning | tee -a "$R/log")
}

pack() { nvidia-smi --query-gpu=name --format=csv,noheader > "$R/gpu.txt"; tar czf "$R/../r.tgz" -C "$R/.." r; }

ab() {  # TREE CONFIG BATCHES ROUND...: main against TREE, the decode step and generate() at BATCHES, a round each
  # (CONFIG "v3cut": the V3 cut gemm fp8; else a config file)
  local tree=$1 config=$2 batches=$3 cmd; shift 3
  cmd="python3 scripts/bench_model.py --config $config"
  [ "$config" != v3cut ] || cmd="python3 scripts/bench_model.py --config configs/config_671B.json --layers 4 \
    --dense-layers 1 --weights fp8 --gemm-impl fp8"
  for round in "$@"; do for v in main "$tree"; do
    LIMIT=${AB_LIMIT:-90} in_tree $v $cmd --decode-batches "$batches" --prefill-batches "" \
      --tag "$(basename "$config" .json)-$v-$round" --out-dir "$R"
  done; done
}

# streamout's tilings: the default first, then the streamed form by rows a program, chunk width, V tile, warps, stages
STREAM_TILES='[{}, {"block_c": 64, "num_stages": 2}, {"block_c": 64, "block_v": 128, "num_warps": 8, "num_stages": 2},
  {"block_c": 64, "block_b": 32, "block_v": 128, "num_warps": 8, "num_stages": 2},
  {"block_c": 64, "block_b": 64, "block_v": 128, "num_warps": 8, "num_stages": 3},
  {"block_c": 128, "block_b": 32, "block_v": 128, "num_warps": 8, "num_stages": 2},
  {"block_c": 32, "block_b": 16, "block_v": 64, "num_warps": 4, "num_stages": 3}]'

# and at V3 (an fp8 wkv_b: chunks of at most 128 columns, one scale each; 16-row programs even at b=1)
STREAM_TILES_FP8='[{}, {"block_c": 64, "block_b": 16, "block_v": 128, "num_warps": 8, "num_stages": 2},
  {"block_c": 128, "block_b": 16, "block_v": 128, "num_warps": 8, "num_stages": 2},
  {"block_c": 64, "block_b": 16, "block_v": 64, "num_warps": 4, "num_stages": 3},
  {"block_c": 128, "block_b": 16, "block_v": 32, "num_warps": 4, "num_stages": 2}]'

stream_sweep() {  # V2LITE_BATCHES [V3_BATCHES]: the output launch alone by STREAM_TILES at V2-Lite's shape, then
  # by STREAM_TILES_FP8 at V3's with its fp8 wkv_b (eight layers: each launch reads one not in L2), five repeats
  LIMIT=170 in_tree so python3 scripts/sweep_mla_tiles.py --config configs/config_16B.json \
    --batches "$1" --kernels output --split-blocks 64 --repeats 5 --output-tiles "$STREAM_TILES"
  [ -z "${2:-}" ] || LIMIT=150 in_tree so python3 scripts/sweep_mla_tiles.py --config configs/config_671B.json \
    --layers 8 --batches "$2" --wkv-b fp8 --kernels output --split-blocks 64 --repeats 5 \
    --output-tiles "$STREAM_TILES_FP8"
}

suite_with() {  # PATCH: the fast GPU suite with PATCH applied to the checkout (before merging it)
  patch -s -p1 < "$1" && PYTHON=python3 bash scripts/gpu_tests.sh > "$R/suite.log" 2>&1
  patch -s -R -p1 < "$1"
  grep -E "^done|GPU suite" "$R/suite.log"
}

case "${1:-}" in
  prep)
    tree main
    tree rotary benchmarks/raw/s60-rotary-bf16.patch  # rotate_rows' angle spread on bf16 tensor cores, exactly
    tree rowsplit benchmarks/raw/s63-mla-row-splits.patch tests  # mla_decode's splits by each row's own length
    tree pre benchmarks/raw/s67-pre-glue.patch  # main before item 82's merge of the glue patch (1a0ada7's kernels)
    tree pref benchmarks/raw/s67-scale-prefetch.patch tests  # fp8 activations' K loops load scales a block ahead
    tree s4 benchmarks/raw/s69-splits4.patch tests  # mla_decode: at least four splits
    tree ow benchmarks/raw/s69-output-weight-first.patch tests  # mla_decode_output: b=1 loads its weights first
    tree kb benchmarks/raw/s70-k-blocks.patch tests  # the grouped kernels' K steps of k_blocks 128-column blocks
    tree kbm benchmarks/raw/s70-k-blocks-model.patch tests  # and the model's fp8 decode launches two blocks a step
    tree tp benchmarks/raw/s72-tile-prologue.patch tests  # a program's tile from one scan and one sum of pairs
    after=; ! grep -q "def sized_tile_width" pallas_kernels/grouped.py || after=-after-tp  # tp merged: its patches
    tree ord benchmarks/raw/s72-tile-major$after.patch tests  # the grouped launches' programs tile-major
    tree walk benchmarks/raw/s72-walk$after.patch tests  # and launches over group sizes walk them, two programs an SM
    tree so benchmarks/raw/s76-streamed-output.patch tests  # mla_decode_output's block_c: the latent streamed
    tree som benchmarks/raw/s76-streamed-output.patch tests  # and the model's decode streaming it above 16 rows
    patch -s -p1 -d .device-data/var-som < benchmarks/raw/s76-streamed-output-model.patch
    tree so3 benchmarks/raw/s76-streamed-output.patch tests  # and the model's decode with an fp8 wkv_b streaming it
    patch -s -p1 -d .device-data/var-so3 < benchmarks/raw/s77-streamed-output-v3-model.patch
    grep -c _spread_exactly .device-data/var-rotary/pallas_kernels/rotary.py
    grep -c "chunk = (length" .device-data/var-rowsplit/pallas_kernels/mla.py
    grep -c "zero_missing" .device-data/var-pre/pallas_kernels/grouped.py
    grep -c "def scaled_body" .device-data/var-pref/pallas_kernels/grouped.py
    grep -c "MIN_SPLITS = 4" .device-data/var-s4/pallas_kernels/mla.py
    grep -c "def _value_block" .device-data/var-ow/pallas_kernels/mla.py
    grep -c "k_blocks: int = 1" .device-data/var-kb/pallas_kernels/grouped.py
    grep -c "FP8_DECODE_K_BLOCKS = 2" .device-data/var-kbm/dsv3_jax/model/moe.py
    grep -c "def sized_tile_width" .device-data/var-tp/pallas_kernels/grouped.py
    grep -c "tile, j = jax.lax.div(program, col_blocks)" .device-data/var-ord/pallas_kernels/grouped.py
    grep -c "WALK_PROGRAMS_PER_SM = 2" .device-data/var-walk/pallas_kernels/grouped.py
    grep -c "def _streamed_output_kernel" .device-data/var-so/pallas_kernels/mla.py
    grep -c "streamed = dict(block_c=64" .device-data/var-som/dsv3_jax/model/attention.py
    grep -c "streamed = {} if scale is None" .device-data/var-so3/dsv3_jax/model/attention.py ;;
  so3model)  # ~250 s: raw/s77-streamed-output-v3-model.patch (the decode step's output launch with an fp8 wkv_b in
    # 16-row programs streaming the latent in 64-column chunks into the head's whole V tile, at every batch) against
    # main, the V3 cut gemm fp8 b=1 and 8 with generate(), one round; edit its tiling first to streamv3's best
    AB_LIMIT=110 ab so3 v3cut 1,8 1
    grep "decode b=\|generate b=" "$R/log"; pack ;;
  somodel)  # ~350 s: raw/s76-streamed-output-model.patch (the model's decode above 16 rows with a bf16 wkv_b streams
    # the latent: block_c 64, 2 stages, the default V tiles) against main, V2-Lite b=32 and 256 with generate(), one
    # round; edit the patch's tiling first if `streamout` found a better one
    AB_LIMIT=170 ab som configs/config_16B.json 32,256 1
    grep "decode b=\|generate b=" "$R/log"; pack ;;
  streamlean) stream_sweep 256 1; pack ;;  # ~200 s: streamv3 at V2-Lite b=256 and V3 b=1 alone
  streamv3)  # ~260 s: streamout's sweep at V2-Lite b=256 and 32 (five repeats, no GPU twins), then the V3 shape's
    # fp8 wkv_b at b=1 and 8 (item 81: 10.3 us a layer at b=1 against ~2 us of bytes; its one-row programs merge the
    # head's whole latent once per 16-wide V block): the default against 16-row programs streaming the latent into
    # one V block
    stream_sweep 256,32 1,8; pack ;;
  sosm)  # ~560 s, one call for a session with little device time: streamout's sweep at b=256 and 32 only (five
    # repeats, no GPU twins), then somodel
    stream_sweep 256,32
    AB_LIMIT=170 ab som configs/config_16B.json 32,256 1
    grep "decode b=\|generate b=" "$R/log"; pack ;;
  streamout)  # ~230 s: raw/s76-streamed-output.patch's mla_decode_output streaming the latent in block_c-column
    # chunks into a V tile's float32 accumulator (16-64 rows a program, loads pipelined over the chunks) against the
    # default whole-latent programs, the launch alone at V2-Lite b=256, 128, 64, 32 (item 77's H200 profile: 587 us
    # a step at b=256, 22.6 a layer against ~5 us of bytes), ten repeats; then the GPU twins of its tests
    LIMIT=300 in_tree so python3 scripts/sweep_mla_tiles.py --config configs/config_16B.json \
      --batches 256,128,64,32 --kernels output --split-blocks 64 --repeats 10 --output-tiles "$STREAM_TILES"
    (cd .device-data/var-so && PYTHONPATH=. timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu \
      tests/test_mla_decode.py -k streaming 2>&1 | tail -3 | tee -a "$R/log")
    pack ;;
  tpsuite)  # ~180 s (H100, warm; ~230 s with its start): the fast GPU suite with raw/s72-tile-prologue.patch (item
    # 87: V2-Lite b=256 step -0.1 %, generate() -0.3 % in two rounds; its suite ran clean but for the tile-table
    # test's GPU twin, which called it without monkeypatch, mended since); merge the patch if it passes
    suite_with benchmarks/raw/s72-tile-prologue.patch; pack ;;
  order)  # ~400 s: raw/s72-swiglu-order.py: the V2-Lite b=256 "fused" swiglu launch alone, main's, against a
    # program a tile from a packed table over the real tiles and over main's bound, in main's order and tile-major,
    # and programs walking the tiles (what made item 86's prototype 10 % faster than main's launch); then the
    # launches of trees ord (raw/s72-tile-major.patch), walk (raw/s72-walk.patch) and main alone
    LIMIT=250 in_tree main env PYTHONPATH=.:scripts python3 ../../benchmarks/raw/s72-swiglu-order.py main \
      "$R/order-main.json"
    for v in ord walk main; do  # the trees' own launches only
      LIMIT=100 in_tree $v env PYTHONPATH=.:scripts python3 ../../benchmarks/raw/s72-swiglu-order.py $v \
        "$R/order-$v-launch.json" tree
    done
    pack ;;
  ordmodel)  # ~520 s: raw/s72-tile-major.patch (the grouped launches' programs tile-major on a 1-D grid) against
    # main: V2-Lite b=32 and 256, the V3 cut gemm fp8 b=1 and 16, with generate(), one round (then a second with
    # ordmodel2 if the first is close)
    AB_LIMIT=140 ab ord configs/config_16B.json 32,256 1
    AB_LIMIT=80 ab ord v3cut 1,16 1
    grep "decode b=\|generate b=" "$R/log"; pack ;;
  orddown)  # ~200 s: item 89: the V2-Lite b=256 sorted launches alone (swiglu and down, 32 x 64, 4 warps, 3 stages:
    # the model's), main against the tile-major tree: the swiglu launch alone was 6.6 % faster tile-major, the model
    # 1.9 % slower; is it the down launch?
    for v in main ord; do
      LIMIT=120 in_tree $v python3 scripts/bench_grouped_decode.py --weights bf16 --shape 64,6,1408,2048 \
        --shared-chunks 2 --layout sorted --batches 256 --block-m 32 --block-n 64 --warps 4 --stages 3 --max-sets 8 \
        --out-dir "$R"
      mv "$R"/grouped-decode-bf16-sorted-*.json "$R/orddown-$v.json"
    done
    pack ;;
  smmodel)  # ~520 s: raw/s74-swiglu-tile-major.patch (the swiglu launches alone tile-major; item 89: the swiglu
    # launch alone 6.6 % faster so, the model 1.9 % slower at b=256 with every launch tile-major) against main, as
    # ordmodel (V2-Lite b=32, 256, the V3 cut gemm fp8 b=1, 16, with generate(), one round)
    AB_LIMIT=140 ab sm configs/config_16B.json 32,256 1
    AB_LIMIT=80 ab sm v3cut 1,16 1
    grep "decode b=\|generate b=" "$R/log"; pack ;;
  walkmodel)  # ~450 s: raw/s72-walk.patch (launches over group sizes on two programs an SM walking their items
    # tile-major: no program launched past the real tiles) against main, V2-Lite b=32 and 256 with generate(), two
    # rounds alternating (V3's 257 groups keep XLA's table: the V3 cut is unchanged)
    AB_LIMIT=110 ab walk configs/config_16B.json 32,256 1 2
    grep "decode b=\|generate b=" "$R/log"; pack ;;
  ordmodel2)  # ~520 s: ordmodel's second round, the patched tree first
    for v in ord main; do LIMIT=140 in_tree $v python3 scripts/bench_model.py --config configs/config_16B.json \
      --decode-batches 32,256 --prefill-batches "" --tag "16B-$v-2" --out-dir "$R"; done
    for v in ord main; do LIMIT=80 in_tree $v python3 scripts/bench_model.py --config configs/config_671B.json \
      --layers 4 --dense-layers 1 --weights fp8 --gemm-impl fp8 --decode-batches 1,16 --prefill-batches "" \
      --tag "v3cut-$v-2" --out-dir "$R"; done
    grep "decode b=\|generate b=" "$R/log"; pack ;;
  suite)  # first on an H200: the fast GPU suite (items 75-77: not run on an H200 since item 72)
    PYTHON=python3 bash scripts/gpu_tests.sh > "$R/suite.log" 2>&1
    grep -E "^done|GPU suite" "$R/suite.log"; pack ;;
  figures)  # ~300 s, on an H200: main's figures for issue 21 (none on an H200 since item 72): V2-Lite b=1, 8, the
    # V3 cut gemm fp8 b=1, 8, gemm bf16 b=1, with generate() (V2-Lite first: a fresh machine's first process may
    # run generate()'s host loop slow, item 72)
    in_tree main python3 scripts/bench_model.py --config configs/config_16B.json --decode-batches 1,8 \
      --prefill-batches '' --tag 16B-main --out-dir "$R"
    V3="python3 scripts/bench_model.py --config configs/config_671B.json --layers 4 --dense-layers 1 --weights fp8"
    in_tree main $V3 --gemm-impl fp8 --decode-batches 1,8 --prefill-batches '' --tag v3cut-fp8 --out-dir "$R"
    in_tree main $V3 --gemm-impl bf16 --decode-batches 1 --prefill-batches '' --tag v3cut-bf16 --out-dir "$R"
    grep "decode b=" "$R/log"; pack ;;
  rotary)  # ~400 s: mla_absorb_query at b=8, 32 per tiling, then the step and generate() at b=1, 8, 32, two rounds
    for v in main rotary; do
      in_tree $v python3 scripts/sweep_mla_tiles.py --config configs/config_16B.json --batches 8,32 --kernels query
    done
    for round in 1 2; do for v in main rotary; do
      in_tree $v python3 scripts/bench_model.py --config configs/config_16B.json --decode-batches 1,8,32 \
        --prefill-batches '' --tag "$v-$round" --out-dir "$R"
    done; done
    grep "decode b=\|mla_absorb" "$R/log"; pack ;;
  rowsplit)  # ~400 s: mla_decode splitting each row's own positions (the static window is past every row's end:
    # 648 here, rows at 512-576), against main: V2-Lite b=256 with generate(), two rounds alternating (item 79: b=32
    # +0.5 % on the step, b=256's generate() -2.3 % in the one round that finished, its step even)
    for round in 1 2; do for v in main rowsplit; do
      LIMIT=140 in_tree $v python3 scripts/bench_model.py --config configs/config_16B.json --decode-batches 256 \
        --prefill-batches '' --tag "16B-$v-$round" --out-dir "$R"
    done; done
    grep "decode b=\|generate b=" "$R/log"; pack ;;
  prefetch)  # ~520 s: three trees alternating, two rounds, the V3 cut gemm fp8 (fp8 activations) b=1 with
    # generate(), b=8 and 16 steps: `pre` (the kernels before item 82's merge), main (the merge: V3's 257 groups
    # read XLA's tile table again, with the zeroing tiles and gathered rows; the patch as first run, tiles in every
    # program, was +2.9 % at b=16) and `pref` (raw/s67-scale-prefetch.patch: the grouped launches and fp8_gemm
    # load each K block's scales a step ahead; on main those loads stall every step, item 82's PTX); then gemm
    # bf16 b=1 for main and pref (dequantized paths, unchanged: a control)
    V3="python3 scripts/bench_model.py --config configs/config_671B.json --layers 4 --dense-layers 1 --weights fp8"
    for round in 1 2; do for v in pre main pref; do
      LIMIT=90 in_tree $v $V3 --gemm-impl fp8 --decode-batches 1,8,16 --prefill-batches "" \
        --tag "v3cut-fp8-$v-$round" --out-dir "$R"
    done; done
    for v in main pref; do
      LIMIT=50 in_tree $v $V3 --gemm-impl bf16 --decode-batches 1 --prefill-batches "" --no-generate \
        --tag "v3cut-bf16-$v" --out-dir "$R"
    done
    grep "decode b=\|generate b=" "$R/log"; pack ;;
  suitewith)  # ~180 s (H100, warm): the fast GPU suite with patch $2 applied before merging it
    [ -f "${2:-}" ] || { echo "suitewith: no patch file '${2:-}'"; exit 2; }
    suite_with "$2"; pack ;;
  kbfp8)  # ~250 s: `kblocks`' fp8 half alone, its output unfiltered (item 86: it printed no row and no error): the
    # V3 slot launches at b=1 by k_blocks, to tell which launch lost at b=1 with kbmodel's two blocks
    # (b=1 alone, 8 timings: item 85's 12 at 8 sets may have run past its 200 s; the log keeps stderr and the rc)
    (cd .device-data/var-kb && PYTHONPATH=. timeout 280 python3 scripts/bench_grouped_decode.py --batches 1 \
      --block-n 32,128 --warps 4 --stages 3 --k-blocks 1,2 --forms fp8 --max-sets 4 --out-dir "$R" \
      > "$R/kbfp8.log" 2>&1; echo "rc $?" >> "$R/kbfp8.log")
    grep -v Warning "$R/kbfp8.log" | tail -30; pack ;;
  micro70) bash "$0" persistent && bash "$0" kblocks ;;  # ~380 s: both of item 85's micro-benchmarks in one call
  persistent)  # ~150 s: raw/s70-persistent-swiglu.py, the "fused" swiglu launch at V2-Lite b=256 alone (main's, one
    # program a tile) against a persistent prototype whose one flattened (tile, K step) loop pipelines through tile
    # boundaries, by tile, stages and programs an SM (item 85; the routed launches run at ~3.7 TB/s at b=256)
    LIMIT=280 in_tree main env PYTHONPATH=.:scripts python3 ../../benchmarks/raw/s70-persistent-swiglu.py \
      "$R/persistent.json"
    pack ;;
  kblocks)  # ~200 s: raw/s70-k-blocks.patch's k_blocks (K blocks a pipeline step: each weight row read in runs of
    # 128 k_blocks elements a step, against 128 fp8 bytes / 256 bf16 bytes on main) alone: the V3 cut's b=1 slot
    # launches (fp8 activations: the swiglu one at ~3.0 TB/s in item 81) and V2-Lite b=256's sorted ones
    LIMIT=200 in_tree kb python3 scripts/bench_grouped_decode.py --batches 1 --block-n 32,128 --warps 4 --stages 3 \
      --k-blocks 1,2,4 --forms fp8 --max-sets 8 --out-dir "$R"
    LIMIT=200 in_tree kb python3 scripts/bench_grouped_decode.py --weights bf16 --shape 64,6,1408,2048 \
      --shared-chunks 2 --layout sorted --batches 256 --block-m 32 --block-n 32,64 --warps 4 --stages 3 \
      --k-blocks 1,2 --max-sets 4 --out-dir "$R"
    pack ;;
  kbmodel)  # ~420 s: raw/s70-k-blocks-model.patch (the fp8 decode launches two K blocks a step) against main,
    # the V3 cut gemm fp8 b=1 with generate(), b=8, two rounds, then gemm bf16 (dequantized: also fp8 weights) b=1
    AB_LIMIT=85 ab kbm v3cut 1,8 1 2
    V3="python3 scripts/bench_model.py --config configs/config_671B.json --layers 4 --dense-layers 1 --weights fp8"
    for v in main kbm; do
      LIMIT=50 in_tree $v $V3 --gemm-impl bf16 --decode-batches 1 --prefill-batches "" --no-generate \
        --tag "v3cut-bf16-$v" --out-dir "$R"
    done
    grep "decode b=\|generate b=" "$R/log"; pack ;;
  prefetch2)  # ~300 s: `prefetch` without the `pre` tree or the bf16 control: main against pref, the V3 cut gemm fp8
    # b=1 with generate(), b=8, 16, two rounds alternating
    AB_LIMIT=90 ab pref v3cut 1,8,16 1 2
    grep "decode b=\|generate b=" "$R/log"; pack ;;
  splits4one)  # ~240 s: `splits4`'s first round alone (V2-Lite b=128, 256; the V3 cut b=16 step)
    AB_LIMIT=110 ab s4 configs/config_16B.json 128,256 1
    AB_LIMIT=80 ab s4 v3cut 16 1
    grep "decode b=\|generate b=" "$R/log"; pack ;;
  splits4)  # ~460 s: raw/s69-splits4.patch (mla_decode at least four splits: item 84's sweep on an H100 had b=128
    # decode + output 97.9 us at 2 splits against 67.3 at 4, b=256 116.2 against 114.3) against main, V2-Lite b=128
    # and 256 with generate(), two rounds alternating, then the V3 cut b=16 (128 heads: 4 splits, 2 on main)
    AB_LIMIT=110 ab s4 configs/config_16B.json 128,256 1 2
    AB_LIMIT=80 ab s4 v3cut 16 1
    grep "decode b=\|generate b=" "$R/log"; pack ;;
  weightfirst)  # ~410 s: raw/s69-output-weight-first.patch (mla_decode_output's one-row programs issue their V
    # block's weight and scale loads before the merge, on main after it: a dependent load after the merge) against
    # main: the output launch alone at b=1 (V2-Lite bf16, the V3 shape fp8), then V2-Lite b=1 two rounds and the V3
    # cut b=1, with generate()
    for v in main ow; do
      LIMIT=60 in_tree $v python3 scripts/sweep_mla_tiles.py --config configs/config_16B.json --batches 1 \
        --kernels output --output-tiles '[{}]' --split-blocks 64 --repeats 10
      LIMIT=60 in_tree $v python3 scripts/sweep_mla_tiles.py --config configs/config_671B.json --layers 4 --batches 1 \
        --kernels output --output-tiles '[{}]' --split-blocks 64 --repeats 10 --wkv-b fp8
    done
    AB_LIMIT=70 ab ow configs/config_16B.json 1 1 2
    AB_LIMIT=70 ab ow v3cut 1 1
    grep "decode b=\|generate b=\|mla_decode_output" "$R/log"; pack ;;
  prefsuite) suite_with benchmarks/raw/s67-scale-prefetch.patch; pack ;;  # ~250 s: the suite with the prefetch
  mlasplits)  # ~250 s on an H200: mla_decode's split count at b=256, 128, 64, 32 with the output launch at its
    # default V tiles and 128 wide (item 82: at b=128, 2 splits (the default) 61.1 us against 40.1 at 3 and 38.8 at
    # 4, but that was the run's first row, maybe before the clocks settled; item 80 had b=128 2 against 3 even end
    # to end on an H100), b=256 first, ten repeats
    LIMIT=280 in_tree main python3 scripts/sweep_mla_tiles.py --config configs/config_16B.json \
      --batches 256,128,64,32 --kernels splits --splits 2,3,4,8 --repeats 10 \
      --split-output-tiles '[{}, {"block_v": 128}, {"block_v": 128, "num_warps": 8}]'
    pack ;;
  v3slots)  # ~250 s (a call of 320 s: item 82's 230 s call was cut off before it printed a row): the V3 cut's b=1
    # slot launches alone (fp8, gemm fp8) by block_n, warps and stages: in the
    # step the swiglu launch reads its 264 MB a layer at ~3.0 TB/s, the down launch at ~3.6 (item 81)
    LIMIT=290 in_tree main python3 scripts/bench_grouped_decode.py --batches 1 --block-n 16,32,64 --warps 2,4,8 \
      --stages 2,3,4,6 --forms fp8 --max-sets 8 --out-dir "$R"
    pack ;;
  tiles256)  # ~350 s: the "fused" launches of V2-Lite b=256 alone (rows sorted by expert, the shared experts'
    # inside) by tile: main runs 32 x 64, 4 warps, 3 stages; where the step's routed launches sit against their bytes
    LIMIT=560 in_tree main python3 scripts/bench_grouped_decode.py --weights bf16 --shape 64,6,1408,2048 --shared-chunks 2 \
      --layout sorted --batches 256 --block-m 16,32,64 --block-n 32,64,128 --warps 4,8 --stages 2,3,4 --max-sets 4 \
      --out-dir "$R"
    pack ;;
  combo)  # ~520 s, for a session with one call: rowsplit at b=32, 256 (b=8's splits are one block either way),
    # then tiles256 on fewer tiles
    for round in 1 2; do for v in main rowsplit; do
      in_tree $v python3 scripts/bench_model.py --config configs/config_16B.json --decode-batches 32,256 \
        --prefill-batches '' --tag "16B-$v-$round" --out-dir "$R"
    done; done
    LIMIT=170 in_tree main python3 scripts/bench_grouped_decode.py --weights bf16 --shape 64,6,1408,2048 \
      --shared-chunks 2 --layout sorted --batches 256 --block-m 16,32,64 --block-n 64,128 --warps 4 --stages 2,3 \
      --max-sets 4 --out-dir "$R"
    grep "decode b=" "$R/log"; pack ;;
  profile256)  # ~100 s on an H200: profiles' b=256 alone, every kernel listed, with the compiled HLO (which ops
    # each fusion holds: the routed scope's 16 XLA launches a layer, 909 us at b=256 in item 81)
    LIMIT=300 in_tree main python3 scripts/profile_step.py --config configs/config_16B.json --batch 256 --pdl off \
      --step unrolled --top 400 --hlo-out "$R/hlo-16B-b256-unrolled.txt.gz" --out "$R/prof-16B-b256-unrolled.json"
    pack ;;
  profv3)  # ~150 s: the V3 cut's (gemm fp8) b=1 and b=8 unrolled steps (what generate() runs), PDL off: where the
    # b=1 step's ~0.9 ms outside the lm head go (item 72's H200 profile was the scanned step, PDL on)
    for b in 1 8; do
      LIMIT=140 in_tree main python3 scripts/profile_step.py --config configs/config_671B.json --layers 4 \
        --dense-layers 1 --weights fp8 --build-kwargs '{"gemm_impl": "fp8"}' --batch $b --pdl off --step unrolled \
        --out "$R/prof-v3cut-fp8-b$b-unrolled.json"
    done
    pack ;;
  slots12)  # ~200 s: the V3 cut (gemm fp8) at b=12 (96 slots: "slots" since item 76, unmeasured) and b=8, 16,
    # fused against slots, step only, two rounds
    for round in 1 2; do
      in_tree main python3 scripts/bench_model.py --config configs/config_671B.json --layers 4 --dense-layers 1 \
        --weights fp8 --gemm-impl fp8 --decode-batches 8,12,16 --moe-impls fused,slots --prefill-batches '' \
        --no-generate --tag "v3-impls-$round" --out-dir "$R"
    done
    grep "decode b=" "$R/log"; pack ;;
  mla256)  # ~320 s: mla_decode at b=256 by tiling and split count (74 us a layer at b=256, ~65 % of the H100's
    # rate), then mla_decode_output by tiling
    in_tree main python3 scripts/sweep_mla_tiles.py --config configs/config_16B.json --batches 256 --kernels decode \
      --decode-tiles '[{"block_t":64},{"block_t":32},{"block_t":32,"num_stages":3},{"block_t":32,"num_stages":4},{"block_t":16,"num_stages":4},{"block_t":64,"num_warps":8},{"block_t":32,"num_stages":3,"num_warps":8}]'
    in_tree main python3 scripts/sweep_mla_tiles.py --config configs/config_16B.json --batches 256 --kernels splits \
      --splits 1,2,4
    # mla_decode_output at b=256 (23 us a layer in item 74's profile against ~5 of bytes): each of the default's
    # two V blocks of 64 merges its rows' splits itself; one program for both, or all 128 columns at once
    in_tree main python3 scripts/sweep_mla_tiles.py --config configs/config_16B.json --batches 256 --kernels output \
      --split-blocks 64 --output-tiles \
      '[{"block_v":64},{"block_v":64,"v_blocks":2},{"block_v":128},{"block_v":32,"v_blocks":4},{"block_v":64,"num_warps":8}]'
    pack ;;
  projections)  # ~300 s: norm_project's tilings against XLA at b=8, 16, 32 (item 74: b=8's first launch 10.1 µs)
    in_tree main python3 scripts/sweep_projections.py --config configs/config_16B.json --batches 8,16,32 \
      --projections wq+wkv_a,wo --tilings '[[32,512,4,3],[32,1024,8,3],[64,256,4,3],[16,512,4,3],[32,128,4,3],[16,256,4,4]]'
    pack ;;
  profiles)  # ~450 s: main's unrolled step (what generate() runs) at b=256, then 128, PDL off: where b=256's ~9 ms
    # outside the routed launches go now. The prompt is prefilled through the scanned step (item 77's unrolled b=256
    # prefill ran out of memory; item 78's, in 64-token chunks, had not finished in 240 s)
    for b in 256 128; do
      LIMIT=220 in_tree main python3 scripts/profile_step.py --config configs/config_16B.json --batch $b --pdl off \
        --step unrolled --out "$R/prof-16B-b$b-unrolled.json"
    done
    pack ;;
  *) echo "usage: $0 prep | streamv3 | streamlean | streamout | sosm | somodel | so3model | micro70 | persistent" \
      "| kblocks | kbmodel | suite | figures | splits4 | splits4one | prefetch2 | weightfirst | prefsuite | output128" \
      "| mlasplits | tiles256 | profile256 | v3slots | rowsplit | profv3 | prefetch | profiles | rotary | slots12" \
      "| projections | combo | mla256" >&2; exit 2 ;;
esac

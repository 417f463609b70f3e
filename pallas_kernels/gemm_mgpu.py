"""Block-scaled FP8 GEMM on Hopper (sm_90) through Pallas' Mosaic GPU backend.

Same contract and numerics as `gemm.fp8_gemm` (``C[m, n] = sum_kb (A_q[m, kb] . B_q[n, kb]) *
a_s[m, kb] * b_s[n // 128, kb]``), written for the tensor cores' fp8 ``wgmma`` instruction, which
the Triton backend never emits (it lowers fp8 dots to mma.sync; benchmarks/NOTES.md):

  * a persistent kernel: one CTA per SM walks the output tiles in a grouped ("planar snake")
    order, so that CTAs running together share A and B tiles in L2;
  * warp specialisation: a producer warpgroup streams (A, B, a_s) K-blocks of 128 with TMA into a
    ring of swizzled SMEM buffers, `num_compute_wgs` consumer warpgroups run wgmma on them;
  * both operands K-major in SMEM (A is (M, K), B is (N, K)), as fp8 wgmma requires;
  * DeepGEMM's scale promotion: each 128-wide K-block's product is computed by wgmma into a fresh
    float32 accumulator, then folded into the running float32 sum as
    ``acc += partial * (a_s[rows, kb] * b_s[n_block, kb])``. A warpgroup's columns lie within one
    128-column block of B, so one b_s value (read from GMEM as a scalar) covers them.

Tails: M is arbitrary: A gets zero rows up to a multiple of 8 and at least one CTA tile (the tiled
TMA copies need both), and the last row tile's rows past that are zero-filled by the TMA loads and
dropped by the TMA stores.
N and K must be multiples of 128 (`mosaic_unsupported` says why a shape is refused, and
`gemm.fp8_gemm` then takes its Triton path).

Without a GPU the kernel runs in Mosaic GPU's interpret mode (`interpret=True`), which simulates
the warpgroups, TMA, barriers and wgmma on the CPU: slow, for small test shapes only.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ._common import BLOCK, cdiv, fail, num_sms

_FN = "fp8_gemm_mosaic"


@dataclasses.dataclass(frozen=True)
class MosaicGemmConfig:
    """Tiling of one Mosaic GPU fp8 GEMM launch.

    tile_m, tile_n: the output tile of one consumer warpgroup (tile_m a multiple of 64, the wgmma
      M; tile_n a multiple of 16 dividing 128, so that one b_s value covers it). Each warpgroup
      holds two tile_m x tile_n float32 arrays (the running sum and a K-block's partial product):
      64x128 or 128x64 is 128 registers per thread.
    num_compute_wgs: consumer warpgroups per CTA (a producer warpgroup comes on top).
    wg_dim: "m" stacks the consumers' tiles along M (CTA tile num_compute_wgs*tile_m x tile_n),
      "n" along N (tile_m x num_compute_wgs*tile_n).
    max_concurrent_steps: depth of the SMEM ring of K-blocks in flight.
    grid_minor: "m" or "n", the dimension the tile order walks first within a band.
    grid_tile_width: width, in CTA tiles, of a band of the planar snake order.
    epi_tile_m, epi_tile_n: the output goes out through SMEM in pieces this size (double
      buffered per warpgroup); they must divide tile_m, tile_n. epi_tile_n None: 128 bytes of
      out_dtype (64 bfloat16 or 32 float32 columns), one swizzle span.
    memory_registers: registers per thread left to the producer warpgroup.
    max_ctas: at most this many persistent CTAs (default: one per SM); each loops over tiles.
    cluster: None, or "m" / "n": CTAs work in pairs (a cluster of 2) on neighbouring tiles along
      that dimension and share the operand they have in common through TMA multicast (B for "m",
      A and a_s for "n"), halving its traffic from L2. (SM-to-SM within a cluster, not NVLink.)
    chain: the producer runs on into a CTA's next tile while the consumers finish the current one
      and store it (one pipeline across tiles: Pallas' START / STEADY / STOP pipeline states).
      Taken only where max_concurrent_steps divides K/128, as Pallas requires, and where every CTA
      has two tiles or more (a lone tile would both fill and drain the ring: no state says so).
    """
    tile_m: int = 64
    tile_n: int = 128
    num_compute_wgs: int = 2
    wg_dim: str = "m"
    max_concurrent_steps: int = 4
    grid_minor: str = "n"
    grid_tile_width: int = 8
    epi_tile_m: int = 64
    epi_tile_n: int | None = None
    memory_registers: int = 40
    max_ctas: int | None = None
    cluster: str | None = None
    chain: bool = True

    @property
    def cluster_size(self) -> int:
        return 1 if self.cluster is None else 2

    @property
    def cta_m(self) -> int:
        return self.tile_m * (self.num_compute_wgs if self.wg_dim == "m" else 1)

    @property
    def cta_n(self) -> int:
        return self.tile_n * (self.num_compute_wgs if self.wg_dim == "n" else 1)

    def check(self) -> None:
        """One-line ValueError naming what is wrong with the tiling."""
        bad = []
        if self.tile_m < 64 or self.tile_m % 64:
            bad.append("tile_m a multiple of 64")
        if self.tile_n < 16 or self.tile_n % 16 or BLOCK % self.tile_n:
            bad.append("tile_n a multiple of 16 dividing 128")
        if self.num_compute_wgs < 1 or self.num_compute_wgs > 3:
            bad.append("num_compute_wgs in 1..3")
        if self.wg_dim not in ("m", "n") or self.grid_minor not in ("m", "n"):
            bad.append("wg_dim and grid_minor 'm' or 'n'")
        if self.max_concurrent_steps < 2:
            bad.append("max_concurrent_steps >= 2")
        if self.grid_tile_width < 1:
            bad.append("grid_tile_width >= 1")
        if self.max_ctas is not None and self.max_ctas < 1:
            bad.append("max_ctas >= 1 or None")
        if self.cluster not in (None, "m", "n"):
            bad.append("cluster None, 'm' or 'n'")
        epi_n = self.epi_tile_n or 32
        if self.epi_tile_m % 8 or self.tile_m % self.epi_tile_m or epi_n % 16 or self.tile_n % epi_n:
            bad.append("epi_tile_m (multiple of 8) dividing tile_m, epi_tile_n (multiple of 16) dividing tile_n")
        if bad:
            raise ValueError(f"{_FN}: {self} needs {'; '.join(bad)}")


def default_mosaic_config(m: int, n: int, k: int, sms: int | None = None) -> MosaicGemmConfig:
    """Tiling for an (m, k) x (n, k)^T product on `sms` SMs: two 64-row warpgroups per CTA, with
    128 columns each (a 128x128 CTA tile) unless 64 (128x64) fills the SMs' last wave better.

    Short M is the case that matters: at M = 512, N = 18432 the 576 tiles of 128x128 take 5 waves
    of 132 SMs (87% busy), the 1152 tiles of 128x64 take 9 (97%). At M = 4096 both are ~100%.
    """
    del k
    sms = sms or num_sms()

    def busy(cta_m, cta_n):
        tiles = cdiv(m, cta_m) * cdiv(n, cta_n)
        return tiles / (cdiv(tiles, sms) * sms)

    wide, narrow = MosaicGemmConfig(), MosaicGemmConfig(tile_n=64)
    return narrow if busy(128, 64) > busy(128, 128) + 0.05 else wide


def mosaic_unsupported(n: int, k: int) -> str | None:
    """Why the Mosaic kernel cannot take an (M, K) x (N, K)^T product, or None if it can."""
    if n % BLOCK:
        return f"N={n} is not a multiple of {BLOCK}"
    if k % BLOCK:
        return f"K={k} is not a multiple of {BLOCK}"
    return None


def fp8_gemm_mosaic_2d(a: jax.Array, a_s: jax.Array, b: jax.Array, b_s: jax.Array, out_dtype,
                       config: MosaicGemmConfig | None = None, interpret: bool = False) -> jax.Array:
    """C = (A * a_s) @ (B * b_s)^T for 2-D, already checked operands (see gemm.fp8_gemm).

    a: (M, K) e4m3, a_s: (M, K/128) f32, b: (N, K) e4m3, b_s: (N/128, K/128) f32; N and K
    multiples of 128. interpret=True runs Mosaic GPU's CPU interpreter instead of compiling.
    """
    (m, k), n = a.shape, b.shape[0]
    if (why := mosaic_unsupported(n, k)) is not None:
        fail(_FN, why)
    cfg = config or default_mosaic_config(m, n, k)
    cfg.check()
    cols = cfg.cta_n * (2 if cfg.cluster == "n" else 1)
    if n % cols:
        pair = " pair" if cols > cfg.cta_n else ""
        fail(_FN, f"N={n} is not a multiple of the {cols} columns of a CTA tile{pair} ({cfg})")
    nkb = k // BLOCK
    # The tiled TMA copies need the row count a multiple of 8 and at least one CTA tile: a ragged
    # or very short A gets zero rows (a copy of A and of C; the rows are dropped afterwards).
    mp = max(cdiv(m, 8) * 8, cfg.cta_m)
    if mp != m:
        a = jnp.pad(a, ((0, mp - m), (0, 0)))
    # a_s goes to SMEM one K-block at a time as a row of cta_m scales: transpose it to (K/128, M).
    a_s_t = jnp.pad(a_s.T, ((0, 0), (0, mp - m)))
    out = _build(mp, n, nkb, jnp.dtype(out_dtype), cfg, interpret)(a, a_s_t, b, b_s)
    return out[:m] if mp != m else out


@functools.lru_cache(maxsize=64)  # pure function of hashable arguments: no mutable state
def _build(m: int, n: int, nkb: int, out_dtype, cfg: MosaicGemmConfig, interpret: bool):
    cs = cfg.cluster_size
    # tiles in units of CTA pairs along the cluster dimension (a pair's second tile may lie wholly
    # past M: its loads read zeros and its stores are dropped)
    m_tiles = cdiv(m, cfg.cta_m * (cs if cfg.cluster == "m" else 1))
    n_tiles = n // (cfg.cta_n * (cs if cfg.cluster == "n" else 1))
    num_clusters = max(1, min((cfg.max_ctas or num_sms()) // cs, m_tiles * n_tiles))
    chain = cfg.chain and nkb % cfg.max_concurrent_steps == 0 and m_tiles * n_tiles >= 2 * num_clusters
    return plgpu.kernel(
        functools.partial(_kernel, m_tiles=m_tiles, n_tiles=n_tiles, nkb=nkb, cfg=cfg, chain=chain),
        out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(num_clusters,),
        grid_names=("sm",),
        cluster=(cs,),
        cluster_names=("cluster",),
        num_threads=cfg.num_compute_wgs + 1,
        thread_name="wg",
        interpret=_interpret_params() if interpret else None,
        kernel_name="fp8_gemm_mosaic",
    )


def _interpret_params():
    return plgpu.InterpretGPUParams()


def _swizzled(rows_bytes: int, itemsize: int):
    swizzle = plgpu.find_swizzle(rows_bytes * 8)
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def _pipeline(cfg: MosaicGemmConfig, nkb: int, op_transforms, share_a, share_b, body, compute_context, state):
    """The warp-specialised K loop of one CTA tile: A, B and A's scales streamed in by 128-wide K blocks."""
    cta_m, cta_n = cfg.cta_m, cfg.cta_n
    return plgpu.emit_pipeline_warp_specialized(
        body,
        grid=(nkb,),
        memory_registers=cfg.memory_registers,
        in_specs=[
            plgpu.BlockSpec((cta_m, BLOCK), lambda kb: (0, kb), transforms=op_transforms,
                            collective_axes=share_a),
            plgpu.BlockSpec((cta_n, BLOCK), lambda kb: (0, kb), transforms=op_transforms,
                            collective_axes=share_b),
            plgpu.BlockSpec((1, cta_m), lambda kb: (kb, 0), collective_axes=share_a),
        ],
        wg_axis="wg",
        num_compute_wgs=cfg.num_compute_wgs,
        max_concurrent_steps=cfg.max_concurrent_steps,
        compute_context=compute_context,
        pipeline_state=state,
    )


def _kernel(a_gmem, as_gmem, b_gmem, bs_gmem, out_gmem, *, m_tiles, n_tiles, nkb, cfg: MosaicGemmConfig,
            chain: bool):
    tm, tn, wgs = cfg.tile_m, cfg.tile_n, cfg.num_compute_wgs
    cta_m, cta_n = cfg.cta_m, cfg.cta_n
    out_dtype = out_gmem.dtype
    op_transforms = _swizzled(BLOCK, 1)  # a 128-wide fp8 K-block: 128-byte rows, 128B swizzle
    epi_m = cfg.epi_tile_m
    epi_n = min(cfg.tile_n, cfg.epi_tile_n or 128 // out_dtype.itemsize)
    out_transforms = _swizzled(epi_n * out_dtype.itemsize, out_dtype.itemsize)
    epi_pieces = [(i, j) for i in range(tm // epi_m) for j in range(tn // epi_n)]
    slots = min(2, len(epi_pieces))
    # a CTA pair along N has the same rows of A (multicast A, a_s); along M the same rows of B
    share_a = ("cluster",) if cfg.cluster == "n" else ()
    share_b = ("cluster",) if cfg.cluster == "m" else ()

    def pipeline(body, compute_context, state=None):
        return _pipeline(cfg, nkb, op_transforms, share_a, share_b, body, compute_context, state)

    ignore = lambda *_, **__: None  # the bodies do not change what the pipeline allocates

    @functools.partial(
        pl.run_scoped,
        allocs=pipeline(ignore, ignore).get_allocations(a_gmem, b_gmem, as_gmem),
        out_smem=plgpu.SMEM((wgs, slots, epi_m, epi_n), out_dtype, transforms=out_transforms),
        collective_axes="wg",
    )
    def _scope(allocs, out_smem):
        wg = lax.axis_index("wg")
        wg_m = pl.ds(wg * tm, tm) if cfg.wg_dim == "m" else slice(None)
        wg_n = pl.ds(wg * tn, tn) if cfg.wg_dim == "n" else slice(None)

        @plgpu.nd_loop((m_tiles * n_tiles,), collective_axes="sm")
        def _tile(info: plgpu.NDLoopInfo):
            (lin,) = info.index
            mi, ni = plgpu.planar_snake(lin, (m_tiles, n_tiles), 1 if cfg.grid_minor == "n" else 0,
                                        cfg.grid_tile_width)
            if cfg.cluster == "m":
                mi = mi * 2 + lax.axis_index("cluster")
            elif cfg.cluster == "n":
                ni = ni * 2 + lax.axis_index("cluster")
            rows, cols = pl.ds(mi * cta_m, cta_m), pl.ds(ni * cta_n, cta_n)
            # this warpgroup's columns start at ni*cta_n (+ wg*tn) and stay within one b_s block
            col0 = ni * cta_n + (wg * tn if cfg.wg_dim == "n" else 0)
            n_block = col0 // BLOCK

            def body(idx, a_smem, b_smem, sa_smem, acc):
                (kb,) = idx

                def partial(part_ref):
                    plgpu.wgmma(part_ref, a_smem.at[wg_m], b_smem.at[wg_n].T)
                    # the scales load while the tensor cores work
                    sa = plgpu.load(sa_smem.at[0, wg_m], layout=plgpu.Layout.WGMMA.reduce(1))
                    sb = bs_gmem[n_block, kb]
                    return part_ref[...], sa * sb  # part_ref[...] waits for the wgmma

                part, s = pl.run_scoped(partial, plgpu.ACC((tm, tn), jnp.float32))
                return acc + part * lax.broadcast_in_dim(s, (tm, tn), (0,))

            def compute_context(run):
                acc = run(plgpu.layout_cast(jnp.zeros((tm, tn), jnp.float32), plgpu.Layout.WGMMA))
                out = acc.astype(out_dtype)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous tile's stores
                dst = out_gmem.at[rows, cols].at[wg_m, wg_n]
                for p, (i, j) in enumerate(epi_pieces):
                    em, en = slice(i * epi_m, (i + 1) * epi_m), slice(j * epi_n, (j + 1) * epi_n)
                    slot = p % slots
                    plgpu.wait_smem_to_gmem(slots - 1, wait_read_only=True)
                    out_smem[wg, slot] = out[em, en]
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(out_smem.at[wg, slot], dst.at[em, en])

            state = None
            if chain:  # a CTA's first tile fills the ring, its last drains it
                P = plgpu.PipelinePipeline
                state = jnp.where(info.local_index == 0, int(P.START),
                                  jnp.where(info.local_index == info.num_local_steps - 1, int(P.STOP), int(P.STEADY)))
            pipeline(body, compute_context, state)(
                a_gmem.at[rows, :], b_gmem.at[cols, :], as_gmem.at[:, rows], allocations=allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

"""Building blocks the ops share, one module per concern (trace-time helpers unless noted):

  common      the DSL import (inert on the GPU host), 16-byte global copies, warp reductions
  stream      the stream design: whole-row CTAs, every cp.async issued before one wait
  decode_mma  mma.sync m16n8k16 GEMV pieces with run-time row bases (gathered tokens, experts)
  wg_ring     TMA-fed warpgroup-mma (wgmma) rings with full/empty mbarriers
  tma         TMA tensor maps a kernel declares and the launcher encodes (host side, no DSL)
  pdl         the programmatic-dependent-launch order (static loads, wait, trigger)
"""

"""The megakernel's stages that have code of their own, one module each (kernels/ops/megakernel.py
runs them; kernels/manifest.toml names each module among its stage's sources, so a change
confined to one module is a change of one stage).

A ring stage (rows: router_rows and down; shared_gu, w13, w2, out) streams its items' weights
through the megakernel's ring (kernels/ops/parts/ring.py) and computes each item with its op's
stream design (kernels/ops/parts/stream.py), or on the tensor cores (shared_gu and out,
kernels/ops/parts/decode_mma.py, with the helpers in common.py). Its class says, for the op it is planned from:
  * `item_bytes`, `cols`: one item's weight bytes and output columns;
  * `region_bytes` and `region(alloc)`: its shared tensors over the stage region (activations,
    the reduction's partials, in kernels/ops/stages/common.py's layout);
  * `load(smem, b, tidx)`: its activations into the region after the stage's waits (coherent
    copies; the caller's barrier follows);
  * `smem["items"]`, in `load` and `item`: the worker's items of the stage, (lo, hi, step);
  * `issue(item, dst, bars, slot, rt, b)`: thread 0 arms the slot and issues the item's weight
    copies (`rt`: the routing's shared copy, read by the routed stages only);
  * `item(item, tidx, smem, b)`: every thread computes the item from its slot `smem["w"]`, with
    one CTA barrier, and writes its outputs.
An item whose rows do not fit one slot is `chunks` ring entries (a stage that has `chunks`, even
1, has this interface), each at most `entry_bytes` of a slot: `issue(item, chunk, dst, bars,
slot, rt, b)` copies entry `chunk` (run time) of it; instead of `item`, `begin(item, tidx, smem, b)` gives the item's state (its
accumulators), `chunk(item, c, state, tidx, smem, b)` computes entry c (trace time) from its
slot and returns the state, and `finish(item, state, tidx, smem, b)` writes the outputs; the
megakernel puts a CTA barrier after each entry (kernels/ops/megakernel.py `_chunked_item`).
`b` is the kernel's buffers by name. combine has no ring: its `item` reads o after its wait.
"""

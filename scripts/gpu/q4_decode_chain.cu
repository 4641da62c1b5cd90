// Development harness for the batch-1 int4 decode chain (q4_gemv.cu's lean kernels and the
// add_rms_norm joins between them), compiled with the GPU machine's own nvcc (no Rust build):
//
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -I crates/tm-kernels/cuda \
//        -o /tmp/q4c scripts/gpu/q4_decode_chain.cu crates/tm-kernels/cuda/attention.cu && /tmp/q4c
//
// (or here, with the pip nvcc: add `-cudart static -L<cu13>/lib` and carry the binary)
//
// It builds 32 Llama-3-8B-shaped int4 layers (random nibbles, group 128) and captures one decode
// step of their products into a CUDA graph, every launch with programmatic stream serialization as
// tm's CUDA backend launches them: add_rms_norm, q/k/v (ln), o (ln4), add_rms_norm, gate/up+SiLU
// (ln), down (ln4) per layer. Forms:
//   early: the joins as built (add_rms_norm triggers its dependents first thing,
//          `tmk::pdl_launch_dependents_early`), so the next GEMV's first weight loads overlap it;
//   late:  the same join with the ordinary (late, implicit) trigger;
//   none:  no joins (the most that removing them could save).
// Optionally with a stand-in for decode attention before o (72 CTAs busy for 6 us), triggering
// early or late, and with `rope_write_kv` after q/k/v. Attention and the LM head themselves are
// not in the chain.
//
// Measured (H200, 2026-12-01, us per step, f16; bf16 within 1%), GEMVs triggering at exit
// (-DTM_Q4_GEMV_EARLY_TRIGGER=0) / after their main loop (the default): late 1768 / 1722, early
// 1703 / 1638, none 1635 / 1566; with the attention stand-in, both late 1984 / 1950, both early
// 1858 / 1814. Also tried here and dropped: the RMSNorm computed again by every CTA of the next
// GEMV in its prologue (x staged in shared memory, o and down adding into the residual): 1796-1818
// against 1761-1768 for the separate kernel; a persistent gate/up grid whose warps' rings run on
// across tiles (grids of 132-448 CTAs): 1649-1985 against 1641; scales and mins staged in shared
// memory per CTA: 1642-1650 against 1646-1653. rope_write_kv in the early chain with the stand-in:
// 1914-1924 against 1813-1820 without it; folded into the q/k/v GEMV in the engine
// (`q4_gemv_ln_rope`) it saved only 9-15 us of a 2.30 ms step, so most of it was already hidden.
//
// `g4`: gate/up+SiLU on tile-major weights with more steps in flight at two CTAs per SM (x loaded
// at use): U = 3 (8 bytes of spills) 1708-1713 us and U = 4 (208 bytes) 1907-1918 us against
// 1686-1699 for silu_lnt's U = 2, early chain with the stand-in (2026-12-01, f16; bf16 alike).
// `at`: decode attention itself (attn_decode_d128, 600 keys in 10 splits, fused combine) between
// q/k/v and o: 1786-1795 us against 1516-1526 without attention and 1687-1699 with the 6-us
// stand-in. Engine ablations on the same day (AWQ b1 replay 2088-2092 us; the kernels cut short,
// garbage out): attention returning right after its wait 1924, after loading Q and its tile 1927,
// skipping only the combine tail (fence, counter, last-CTA merge) 1988; add_rms_norm returning at
// once 1989, both 1837. Tried here and in the engine, not kept: the combine's partials copied
// into shared memory with the (max, sum) pairs (one L2 trip): harness 1790 -> 1772, engine
// 2148 -> 2155; attention copying its first K/V tile before its wait (all but the newest key):
// harness none, engine 2142 -> 2148; the splits merged through distributed shared memory in a
// thread-block cluster (committed and reverted, see `git log -S cluster_combine`: attn_decode_bench 11.3 -> 9.6 us at 550
// keys, engine 2172 -> 2247 us). The RMSNorm folded into q/k/v and gate/up (x = the residual
// times the norm weight per step, squares summed on the side, the sums scaled by the CTA's rsqrt
// at the end; no add_rms_norm kernels; mode `nf` of commit 78579e0, removed since: a copy of the
// lean loop): 1846-1856 us against 1728-1734 with the joins and 1608-1615 without them: the norm
// weight's load and the multiply sit on the at-use x path of every step. This harness's q/k/v is `lnt` at three CTAs per SM, the engine's
// `lnt_rope` at two, so attention's start is not modelled exactly.
//
// Mode `dn` of commit 7feb5e9 (reverted after it; 2026-12-01, H200, f16, the chain
// as the engine runs it: lnt_rope, attn_decode, ln4t, silu_lnt, ln4t): the RMSNorm deferred into
// the products. The producer (o, down: `q4_gemv_ln4t_join`) ends with the join's elementwise part,
// residual = T(residual + T(y)), x = T(residual * gamma), and per CTA the sum of squares of its
// rows; the consumers (lnt_rope, silu_lnt) read x as usual and multiply their sums by the row's
// 1 / rms before their epilogue; no add_rms_norm kernels. Joins 1825-1845 us, no norm at all
// 1732-1775. The producer's part costs ~5 us in all (joins off, producers joining: 1741-1784); the
// consumers' part is what decides, because every cycle added to a consumer's epilogue is paid
// per CTA wave (silu_lnt: 896 CTAs, 3.4 waves) with the next kernel waiting: scaling by a constant
// +0 us; one L2 load in the epilogue +49-70 us (the weight stream makes L2 latency long); the
// partial sums staged by cp.async after the wait and reduced in shared memory +145 us (two extra
// barriers +150); a float2 of partials per thread loaded after the wait and warp-reduced +62-86;
// thread 0's load only (a stand-in for one pre-reduced sum per batch row) +40, which would make the
// deferred chain 1759-1786 us against 1831 with joins (-45..-72). That design, built (a scratch copy
// of 7feb5e9: each producer CTA atomicAdds its sum into one float per batch row of its slot, o's
// slot A and down's B, and zeroes the other slot; the consumers __ldcg their row's sum right
// after the wait and scale by rsqrtf at the end): 1792-1798 us against 1822-1832 with joins, four
// alternations, i.e. -30..-38 us per step (1.6-2%); not bit-reproducible (float atomics), and the
// slot protocol needs every step's producers all deferred or none (a last down deferred too).
// Also: ptxas hoisted an `__ldg` of the sums above `griddepcontrol.wait` (ld.global.nc promises the
// data does not change while the kernel runs), which is how the same hoisting of q4_gemv.cu's x
// loads was found (ABI.md, PDL). The SiLU epilogue's IEEE division against `__fdividef`: -3 us.
//
// Arguments: none (the forms above), `wq`, `pk`, `smi` (session 18, below), `iso`, `bk`, `sm` (session 13, below), `v` (session 14), `tl` (the lean kernels against their tile-major forms, `lnt`,
// `ln4t`, `silu_lnt`, the weights read as if stored tile-major: the layout's speed is the same for
// random nibbles), `g4`, `at` (above), `pf` (the attention stand-in issuing `cp.async.bulk.prefetch.L2` of the first
// MiBs of the next gate and up weights). Measured 2026-12-01 (f16; bf16 within 1%): tile-major
// 1567 -> 1438 us per step without joins, 1814 -> 1698 us early with the stand-in (now the CUDA
// backend's layout for these shapes); L2 prefetch of 4 / 8 / 12 / 16 MiB of each: 1820 -> 1790 /
// 1783 / 1769 / 1790 us (from row 4224: 1802-1796), not pursued. Staged x (each CTA copying x into
// shared memory once, pre-permuted into the mma B operands with per-group sums, so the loop needs
// no PRMT, ones-mma or high-nibble shifts: 25-31% fewer SASS instructions per step) was slower,
// 1572 -> 1635 us without joins: the staging adds a dependent load, reduction and barrier before
// each CTA's first step, and the loop is bound by the weights' DRAM pattern, not by issue.
//
// Session 13 (2026-12-01, H200, f16; bf16 within 1%; modes `iso`, `bk`, `sm`; the chain as the CUDA
// backend runs it: lnt, attn_decode, ln4t, silu_lnt, ln4t, early joins):
// - `iso` (each product alone, 32 launches over the 32 layers' weights in one graph, PDL): gate/up
//   silu_lnt at U = 2, two CTAs per SM, 21.9 us = 2.85 TB/s; down ln4t 11.9 us = 2.62 TB/s; a
//   plain streaming read of the gate and up bytes 12.6 us = 4.68 TB/s; the lean loop with its math
//   replaced by an XOR of the loaded words (a hook in q4_tiles_lean, not kept) 14.2 us (U = 2) /
//   14.6 (U = 4): the access pattern reaches 4.4 TB/s, the step math is what bounds gate/up. ncu
//   (silu_lnt): 1.6 IPC per SM, 3.6 warps active per scheduler and 0.79 eligible, 9 cycles per
//   issued instruction (3.3 of them on L1TEX), 7.9 M instructions per launch.
// - More warps per SM (`sm`): gate/up at U = 1 with x loaded with the weights, three CTAs per SM
//   (79 registers, no spills): iso 21.5 us, chain 1766 against 1786 us; in the engine (AWQ 8B b1
//   replay) 2080 us against 2126-2130, so it is `silu_lnt` now. U = 2 at three or four CTAs per
//   SM spills (260-350 B): 35-41 us; U = 1 at four per SM (64 registers, 68-112 B spilled) 22.9 /
//   29.7 us. The same for o and down in the engine (their deferred joins): a 512-thread join (16
//   warps splitting K, U = 1 with x, 60 registers; two CTAs and 32 warps per SM) 2102-2105 us
//   against 2096-2097 for ln4t_join: dropped (their 256-CTA grids, not registers, cap the warps).
// - Weights staged in shared memory (`bk`, `iso`; every form bitwise equal to the lean kernels):
//   TMA bulk copies (`q4_tiles_bulk` below: 8 KiB per tile and 1024-column chunk on an mbarrier,
//   S stages) and a per-lane cp.async ring (`q4_tiles_async`): gate/up 21.2 / 23.5 us (bulk S = 2
//   / 4), 26.5-28.6 (cp.async U = 4-6); down 13.3-14.5 (bulk) and 12.0-13.9 (cp.async) against
//   11.9; the chain +65..+260 us. With the math replaced, bulk staging reads at 3.8 TB/s. A
//   persistent gate/up whose TMA ring runs on across its tiles (grids 264 / 299 / 448): 22.4-30.9
//   us, chain +110..+290 us.
// - Also not kept (hooks in q4_gemv.cu): the step math with low and high nibbles in separate
//   accumulators (mma chains of 4 instead of 8) and with f16's high nibbles unshifted (two shifts
//   fewer per word): gate/up 21.9 us either way, chain within +-15 us; each CTA's tiles prefetched
//   into L2 up front (`cp.async.bulk.prefetch.L2`, whole or past the first U steps): gate/up 25.2
//   us, down 14.3-14.5, chain +230..+260 us.
// - The lean loop with fewer live pointers (one per tile and array, row g + 8 by an offset): the
//   80-register silu_lnt still recomputes its load addresses every step (about 60 of the loop's
//   287 SASS instructions; 304 before), and the engine's step is unchanged (2078-2079 us against
//   2075-2080): not kept. Its scales and mins staged per CTA in dynamic shared memory instead (one
//   16-byte load per thread, a barrier, two LDS per row and step: 80 registers, loop 275
//   instructions): 2124-2129 us against 2076-2080: not kept.
//
// Session 14 (2026-12-01, H200, f16; bf16 alike; mode `v`: the shipped gate/up and down alone,
// with the bitwise check against the bulk kernel and the f32 reference, built with -D variants):
// - Lean loops with per-CTA bases and per-lane 32-bit offsets shared by the tiles (shipped since):
//   silu_lnt 282 SASS instructions per step against 308, iso 21.55 -> 20.96 us; engine AWQ 8B b1
//   replay 2056-2065 us against 2072-2082 (four alternations).
// - x staged in shared memory once per CTA (n = 1 only, 8 KiB), read at use: loop 259
//   instructions, iso 20.66 us, but the engine's step 2072-2077 (no gain); the same staged but
//   buffered with the weights 21.6 / 2110; at four CTAs per SM (40 B spilled) 21.6 us.
// - Engine only (kernel builds with -D variants): q/k/v RoPE at U = 1 with x loaded with the
//   weights at three CTAs per SM 2119-2122 us; the o/down join at U = 6 / 7 (two per SM)
//   2113-2114 / 2141-2145; attention partitions of at least 128 / 192 keys
//   (TM_ATTN_MIN_PARTITION) 2115 / 2173-2176: all against 2060-2065, none kept.
// - Engine only: the o/down join (`ln4t_join`) at U = 3 instead of 4, two CTAs per SM (128
//   registers either way): AWQ 8B b1 replay 2014-2020 us against 2061-2071 (three alternations;
//   shipped since); U = 2 at three CTAs per SM 2172-2183, U = 1 at four 2307-2312. Dense gemv
//   (the LM head: 243 us in ncu, 4.32 TB/s) with 8 / 16 chunks in flight per lane instead of 4:
//   AWQ 2063-2068 against 2063-2070, bf16 4737 / 4631 against 4487: not kept.
// - Mode `fl` (commit "harness mode fl", reverted after it; see `git log -S GroupReady`): down
//   waiting per 128-column group of its input on counters that each gate/up CTA bumps when done,
//   instead of griddepcontrol.wait on the whole gate/up grid (so down's early steps could run
//   during gate/up's last wave). Bitwise equal, but slower: 32 layers of gate/up + down 32.6 us
//   per layer with the grid wait against 38.8-39.5 with counters (every fence form: all threads,
//   thread 0 after the barrier, red.release; spinning or __nanosleep 100 / 500 ns), 36.5 with x
//   read through L1 (not guaranteed coherent), and 34.9 for the grid wait with gate/up's
//   red.release and x through L2: the last gate/up wave is not idle, and down's x at use through
//   L2 costs its latency per step.
//
// Session 15 (2026-12-01, H200, engine only, AWQ 8B b1 replay, f16; kernel builds A/B'd through
// TM_KERNELS_DIR with one binary; base 2000-2013 us):
// - Decode attention's CTAs issuing `cp.async.bulk.prefetch.L2` of the leading bytes of the
//   layer's gate and up (and their scales and mins) before their wait (the `pf` experiment above
//   in the engine; built as a hint in AttentionMeta, then reverted): 24 / ~30 / 40 MiB in all
//   2094 / 2114-2118 / 2158 us against 2009-2014 without: every MiB pulled while attention runs
//   costs ~3.5 us (it delays attention's own loads and o's first weights, the critical path).
// - The o/down join's weight steps issued before `pdl_wait` limited to P of its U (a knob
//   TM_Q4_PRE_WAIT, not kept): U = 3 with P = 2 / 1 / 0: 2016-2020 / 2031 / 2054 us against
//   2000-2007; down at U = 4 with P = 1 / 2: 2051-2058. gate/up (U = 1) waiting before its one
//   step 2007; q/k/v RoPE (U = 2) with P = 1 / 0: 2003 / 2016. So the loads issued under the
//   predecessor's tail are worth having; deeper rings lose for another reason.
// - The o/down join at U = 2 (two CTAs per SM, as at U = 3): 1984.5 / 1994.3 against 1999.8-2011.8
//   (shipped); o at U = 1 2055; q/k/v RoPE at U = 3 (12 B spilled) 2138 against ~2115 (prefetch
//   build); down alone at U = 4 / 2 (o at 3) 2148 / 2104 against ~2115 (prefetch build).
// - The fused attention combine counting with one `atom.acq_rel.gpu` after the barrier instead of
//   a `__threadfence` per thread, atomicAdd, atomicExch and a fence: 1999.8-2006.6 against
//   2011.8-2014.3 (shipped). Greedy argmax split over 16 blocks per row (ncu: 4.1-4.9 + 2.8 us
//   against 10.6-11.6; outside the replay: TPOT only; shipped).
//
// Session 16 (2026-12-02, H200, engine only, AWQ 8B b1 replay, f16; base 1986-1992 us):
// - ncu of the shipped step (kernels alone, no PDL overlap; per launch): silu_lnt 23.5 us,
//   ln4t_join 9.9 (o and down), lnt_rope 9.7, attn_decode 9.6, the LM head's gemv1 238.7, the
//   last down (ln4t) 14.2, embedding / rms_norm / add_rms_norm / gather_rows / fill_zero 1.9-3.9:
//   2.26 ms of kernels in a 1.99 ms replay.
// - The split-K attention combine merging in registers, one L2 round trip for up to 12 splits
//   (`combine_chunk` in attention.cu; shipped): 1972.9-1985.5 against 1990.6-1991.9; with 8 splits
//   per chunk (two trips at 10 splits) no gain, so the trip, not the barriers, was the cost.
// - Decode steps feeding the final norm's output to the LM head without gather_rows (shipped, a
//   kernel fewer): 1978.3-1982.6, within the noise of the step before it.
// - The LM head as a persistent streaming GEMV: -8 us alone, +40 us in the engine (see
//   scripts/gpu/lm_head_gemv.cu); not kept. gemv.cu's dense kernels issuing their first chunk
//   batch before `pdl_wait` (a hand-written entry; overlay cubin): AWQ 1973.7 / 1977.0 against
//   1974.3 / 1975.2, bf16 4485.6 / 4489.1 against 4465.6 / 4470.3: not kept either (so the pre-wait
//   loads alone do not explain the streaming kernel's loss).
//
// Session 17 (2026-12-02, H200, engine only, AWQ 8B b1 replay, f16; kernel variants overlaid
// through TM_KERNELS_DIR on one binary; base 1966-1976 us):
// - Decode attention (T cache) copying the keys of its first tile that precede the newest one
//   before `pdl_wait` (shipped: attention.cu's `attn_decode`): 1950.9 / 1950.1 / 1957.4 against
//   1973.8 / 1975.2 / 1969.9 (alternated). The same idea tried earlier (above: "attention copying
//   its first K/V tile before its wait", engine 2142 -> 2148) was measured on a slower chain.
//   The same for fp8 caches (attn_decode's kv8 path, attn_decode_gqa_d128_kv8; shipped):
//   --kv-cache-dtype fp8 2047.5 / 2048.3 against 2069.8 / 2069.5.
// - q/k/v with RoPE triggering its dependents first thing (so that attention's CTAs start, and
//   copy their keys, during all of q/k/v): 2046.7-2049.6 alone, 1998.4-2009.5 with the copies:
//   +75 / +30 us (the cascade also lets o's CTAs take slots early). Not kept.
// - The step's edges deferred too (branch `defer-edges`, 571e100 and its revert 114eef4): the
//   embedding as the step's first deferred join (one kernel for fill_zero, embedding and layer 0's
//   rms_norm) and the last down's join into the final norm folded into the LM head's GEMV:
//   1971.5 against 1971.9 us (means of six alternations in two calls): three kernels fewer, no
//   time; not kept.
// - LM head chain probe (scripts/gpu/lm_head_gemv.cu, chain mode): `cur` adds 242.8 us after the
//   down and norm stand-ins; the persistent kernel at 4 blocks per SM 239.3 (post-wait) / 239.9
//   (pre-wait), at 2 per SM 247.5-248.4, with queued rows (`dyn`) 253.1-257.6. At most -3.5 us,
//   so the engine's +40 us for `gemv_stream` stays unexplained; not pursued.
// - Decode attention's gqa kernel stages (TM_ATTN_GQA_STAGES, fp8 caches only) 2 / 4: 1970.3 /
//   1975.8 (f16 cache: not used; noise).
// - The o/down joins with 32 rows per CTA (two tiles per warp step, 128 CTAs, 121 registers, so
//   that attention's or q/k/v's CTAs could sit beside them: with 16 rows, 80 attention CTAs leave
//   room for only 184 of o's 256 CTAs, the rest start after attention ends): o only 2032-2038 us,
//   o and down 2243-2249, against 1955-1961 (built as `q4_gemv_ln4t_join32` with a launcher
//   knob, then dropped): fewer, fatter CTAs lengthen every warp's chain of steps.
// - Final binary (96dfb74) in two calls: 1955.0-1962.6 us (seven runs, mean 1958.7); bf16
//   4405.0-4405.1 (its attention copies early too): 2.25x; copy bandwidth (4 GiB, median of 20)
//   4.238 TB/s -> roofline 1370.8 us -> 70.0% (69.8-70.1).
//
// Session 18 (2026-12-02, H200, f16; bf16 within 1%):
// - Mode `wq`, gate/up (silu_lnt, 3 CTAs per SM) on grids of G CTAs (16 G rows), 32 launches:
//   G = 132 / 264 / 396 (one wave) / 448 / 528 / 660 / 792 (two) / 896: 6.44 / 8.43 / 9.58 / 13.31 /
//   14.37 / 15.77 / 17.76 / 20.92 us. A wave's few last CTAs cost a whole CTA lifetime (396 -> 448:
//   +3.7 us); at 792's rate per CTA, 896 CTAs would take ~20.1 us, so the 2.26 waves cost ~0.8 us
//   per layer. The same layer's weights launched 32 times (L2 can hold up to G = 396's 26 MB, but
//   the loads are evict-first): 3-5% faster at every G. down (ln4t) 11.94 us, same layer 11.55.
// - Mode `pk`, an L2 prefetch kernel between q/k/v and attention (with attn_decode): the kernel
//   alone (no bytes) 1732-1734 us against 1708-1714 without (a PDL hop costs ~0.7 us), o's 8.6 MB
//   1740, 8 / 12 / 16 MiB of gate and of up 1819 / 1885 / 1951, o and 8 / 12 MiB 1883 / 1952: as in
//   the engine in session 15, what is pulled while attention runs delays it and o.
// - Engine (AWQ 8B b1 replay; shipped 1951.7-1955.8 us): ln4t_join at three CTAs per SM (U = 2, 80
//   registers, no spills) 2127.4-2129.8 (as session 14 found); gate/up triggering its dependents
//   first thing (so down's CTAs start in gate/up's last wave) 1949.5 / 1957.0 / 1954.9 against
//   1953.6 / 1955.5 / 1954.9: nothing; decode attention without its combine tail (the partials
//   written, no count, no merge: garbage out, timing only) 1877.1-1881.6: the fused combine costs
//   ~76 us per step, the most that merging elsewhere could win.
// - gate/up in CTAs of 4 warps (8 steps each; a `W` parameter of q4_tiles_lean, removed since) at
//   7 per SM (72 registers, 40 B spilled), so that all 896 CTAs are resident in one wave: iso 21.28
//   us against 20.92 for silu_lnt; at 6 per SM 22.75; chain +10 / +57 us. Neither the single wave
//   nor longer warp streams help: the kernel is bound by its per-SM work, not by waves.
// - Each warp prefetching its next step's weights into L2 (`prefetch.global.L2`, one line per lane,
//   a `PF` parameter, removed since): gate/up 21.5 us against 21.5 without (harness kernel), down
//   13.8 against 10.5; chain +20 (gate/up) / +220 us (all).
// - Mode `smi`: scales and mins interleaved tile-major (`Tile::smi`, q4_tiles_lean's SMI; one
//   8-byte load per lane and tile per step, 64 consecutive bytes per warp, instead of four 2-byte
//   loads each touching 8 rows' sectors). Outputs bitwise equal. gate/up (silu_lnt's loop) iso
//   20.19-20.30 us against 20.84-20.97 for silu_lnt; down (ln4t_join's loop without the join, U = 2)
//   11.32-11.39 against 10.50-10.58 (slower: row-major scales of the CTA's 8 warps share L1
//   sectors); q/k/v as lnt_rope runs it (two tiles per CTA, U = 2, no RoPE: `qkv2`) +6..+13 us per
//   step. Chain (attn_decode, o/down as plain U = 2 kernels), per step: silu_lnt 1679.2 / 1681.5 /
//   1682.2 us, the same loop with smi 1660.8 / 1660.7 / 1664.2 (f16; bf16 1672-1673 against
//   1654-1655): -19 us. The scales and mins kept as two f16 arrays but each in that tile order
//   (SMI = 2: two 4-byte loads per lane and tile per step; flag 2 of the mode's kernels): gate/up
//   iso 20.46 us, chain 1659.0-1661.4 against silu_lnt's 1671.9-1680.1 (bf16 1655.6-1658.8
//   against 1671.4-1674.9): -15 us, nearly smi's gain with no new tensor, so the engine took it
//   (tm-core `Int4Layout::TilesAndScales16x128`, gate and up only; o/down with it: +40 us). In the
//   engine (AWQ 8B b1 replay, `TM_GATE_UP_TILED_SCALES=0` against the default, five
//   alternations in two calls): 1942.7-1949.7 us against 1951.9-1962.2, -10 us.
//
// Session 21 (2026-12-05, no GPU) built and session 22 (2026-12-06, H100 80GB HBM3: the call
// got an H100; engine only, AWQ 8B b1 replay, f16, scripts/gpu_b1_ab.sh, two alternations)
// measured, then removed: q4_gemv.cu's TM_Q4_PF_SILU / _JOIN / _ROPE (q4_tiles_lean's PF: the
// weights of the PF steps after the register ring asked into L1 with `prefetch.global.L1`, the
// first PF before the PDL wait; 80 / 128 / 124 registers unspilled at 1). Base 2279.7 / 2277.9
// us; all three at 1: 2393.1 / 2397.7; gate/up alone 2351.8 / 2351.8; o/down alone 2303.7 /
// 2307.8. Like session 18's per-warp L2 prefetch, the extra requests cost more than the depth
// they add. Same call: bf16 b1 replay 5696.2 us (2.50x the AWQ step on the H100), copy bandwidth
// 3.022 TB/s (AWQ at 84.4% of its 1922 us roofline there).
// - Session 22, second call (same H100 kind, 3.005 TB/s): a layer's o with every weight step in its
//   ring before the PDL wait (`ln4t_join` at U = 4 where cols <= 1024 U, down still at 2; a knob
//   TM_Q4_JOIN_SHORT_U, removed after): 2300.2 / 2301.8 us against 2278.4 / 2279.1; at U = 3
//   2279.0 / 2281.4. So the o weights still missing after the wait are not on the critical path
//   (their refills overlap the first steps' math), and the extra loads during attention cost.
// - The budget left for b1 on the H200 (2.4x bf16's 4405 us replay = 1835 us, against 1942-1950 now): ~110 us
//   per step, ~3.4 us per layer. Per layer now (sessions 13-18): gate/up ~21 us for 60.5 MB (14.3
//   us at copy bandwidth), down ~12-14 for 30.2 MB (7.1), q/k/v ~6 for 6.3 MB (1.5), o ~5 for
//   4.2 MB (1.0), attention ~8 in the chain for 2.5 MB of keys and values (0.6), i.e. ~26 us a
//   layer above the weights' stream: the small kernels' latency (each a PDL hop, an x load from
//   L2 and a reduction) and gate/up's and down's issue-bound loops (gate/up's weights served from
//   L2 made it only 3-5% faster); the next entry says which of the two the H200's gap is.
// - What the H100 adds (session 22): the same binary and kernels reach 2.50x bf16 there (AWQ 2278
//   us, 84% of its 1922 us roofline at 3.0 TB/s; bf16 5697 us, 93%). Scaled by bandwidth alone the
//   H100's step would be 2278 x 3.005 / 4.238 = 1615 us on the H200; it is 1947. The products
//   whose loops run at ~2.6-2.9 TB/s (gate/up 2.85, down 2.62 in `iso`) are near the H100's copy
//   bandwidth but far below the H200's, so on the H200 the gap is mostly their instruction-bound
//   rate (about 6.7 + 5 us a layer), not the small kernels' latency (which the H100 pays too).
//   The lever is the lean loop's work per weight byte or its latency hiding at ~1.6 IPC, in
//   gate/up and down; each past attempt at that is listed above (sessions 13, 14, 18, 21-22).
//
// Session 23 (2026-12-06; engine only, AWQ 8B b1 replay, f16, scripts/gpu_b1_ab.sh; every knob
// built with gpu_kernel_variants.sh; the unroll and silu_lnts knobs removed after, the ablations
// kept):
// - H200 (copy bandwidth 4.282 TB/s; three alternations): base 1957.0 / 1955.7 / 1952.5 us,
//   bf16 4440.8 / 4440.6 in the same call: 2.27x, 69.5% of the 1356.7 us roofline. The lean loop of a 4096-column
//   product (J = 4 steps per warp) unrolled whole, so that each refill and its use share one
//   basic block and ptxas may issue the refills early (`TM_Q4_UNROLL_J=4`: gate/up, q/k/v and o;
//   silu_lnts then spills 64 B): 2065.1 / 2063.3 / 2060.8; with down's J = 14 unrolled too: 2212.7
//   -2221.7; uj4 with silu_lnts at two CTAs per SM (128 registers, 48 B spilled): 2049.1-2049.4;
//   silu_lnts at U = 2 and two CTAs per SM without the unroll (128 registers, no spills):
//   2075.2-2081.3. q4_gemv_bench's gate/up (silu_lnt's loop) in a graph: 20.4 us base, 23.4
//   unrolled. ptxas hoists the unrolled refills as far as registers allow and spills for them;
//   the rolled loop, which issues each refill only after the step's epilogue, is faster.
// - Predicated refills (one basic block without the unroll: the loop's `if (j + U < J)` as
//   predicated inline-asm loads, with the step's math reordered tile by tile so that registers
//   free early; not measured): ptxas still sinks every refill below the step's last HMMA and
//   FFMA (a load whose consumer is in the next iteration has no critical path in this one), and
//   the reordered step spills 24-56 B at 80 registers. Only scheduling across the back edge
//   (the unroll above) moves them, and that lost.
// - Ablations of the lean step (q4_gemv.cu's TM_Q4_ABLATE_*, kept there for the H200; timing
//   only, the sums are wrong), two calls on H100 80GB HBM3 (no H200 came): copy bandwidth 3.032
//   TB/s, base 2233.9-2242.4 us (four alternations), without the ones-mma (`nx`, 8 of a gate/up
//   step's 24 HMMAs) 2219.5-2222.1, without it and the per-step scale and min (`nxe`: 189 SASS
//   instructions a gate/up step against 252, and the scale and min loads, ~6% of the bytes, go
//   too) 2114.6-2119.6; 3.024 TB/s, base 2276.6 / 2278.7, nx 2255.6 / 2258.0, without the nibble
//   extraction (`nr`: 181 instructions a step, its 123 LOP3s and SHFs gone, 53 register moves
//   in their place) 2257.2 / 2257.7, nxe 2145.7 / 2150.2.
//   q4_gemv_bench (second call, silu_lnts) gate/up in a graph 24.7 / 24.5 / 24.3 / 22.6 us, down
//   (`ln`) 15.0 / 13.8 / 13.6 / 12.5. So on the H100 the step is bound by bytes: 28% fewer
//   instructions in the loop save under 1%, 6% fewer bytes save 5.7%. On the H200, where the
//   loops run below its bandwidth, the same three (`VARIANTS="base nx nr nxe"`) say which part
//   of the step bounds them; not measured yet (the calls that asked for an H200 got H100s or
//   none).
//
// Session 24 (2026-12-06; engine only, AWQ 8B b1 replay, f16, scripts/gpu_b1_ab.sh): of thirteen
// calls that asked for an H200, twelve got an H100 80GB HBM3 (the command checks the name first
// and exits at once on anything else, ~25-85 s a try) and one an H200.
// - The ablations on the H200 (copy bandwidth 4.236 TB/s; three alternations; the base cubin is
//   byte-identical to the shipped one): base 1953.2 / 1946.5 / 1942.3 us; nx 1904.0 / 1905.3 /
//   1904.4 (-43); nr 1907.4 / 1903.8 / 1898.8 (-43); nxe 1776.4 / 1775.0 / 1776.8 (-170); bf16
//   4409.1 / 4405.6 in the same call: base 2.26x (70.4% of the 1371.5 us roofline), nx 2.31x,
//   nxe 2.48x. Twice the H100's savings for each (-22 / -20 / -130 there), so the H200's step
//   does pay for the loop's work, but no one part is the bound: the ones-mma and the nibble
//   extraction are ~2% each, the per-step scale and min (their loads and the epilogue's f32
//   math) ~6.5%. 2.4x needs <= 1836 us here, -110 us: nx and nr together (if they add) about
//   -85, so the epilogue has to give some too. q4_gemv_bench (H200, graph, n = 1) base / nx /
//   nr / nxe: gate/up (`ops`, silu_lnts) 20.5 / 19.6 / 20.0 / 18.3 us (14.7 us at the bench's
//   4.246 TB/s); down (`ops`) 11.9 / 11.1 / 11.2 / 9.9 (7.3); q/k/v (`ln` graph) 6.1 / 5.7 /
//   5.5 / 5.1 (3.1); o 5.3 / 4.8 / 4.7 / 4.5 (2.1). q/k/v and o, short (J = 4) and few CTAs,
//   run at 40-55% of the copy bandwidth: their ~6 us a layer over the roofline are latency
//   (pipeline fill and drain), which less loop work shortens only a little.
//   Next, in order of payoff per effort: (1) X (the per-group sums of x) from the producers
//   (f64 atomics of the f16 values are exact and order-free, so bit-reproducible; one slot per
//   step like the norm sums; o's x comes from attention, so o keeps the ones-mma) to replace
//   the ones-mma in gate/up, down and q/k/v: <= -43 us less the cost of one X load a step;
//   (2) the per-step epilogue: a batch-1 specialisation that updates only the valid column
//   (e = 0, 2: half the FFMAs; the loads of scales and mins were reshaped in session 18, `smi`,
//   with little effect); (3) the extraction (f16's high nibbles unshifted into a second
//   accumulator, which the 80-register silu_lnts can't afford without (1)'s freed registers).
// - Two more ablations (q4_gemv.cu, default off, shipped cubin byte-identical): `nl`
//   (TM_Q4_ABLATE_SMLOAD: no scale and min loads, a loop-invariant scale and min instead, so the
//   epilogue's FFMAs stay; silu_lnts 17 LDGs against 25, 536 SASS instructions against 600) and
//   `no` (TM_Q4_ABLATE_ODD_E: the epilogue skips batch columns 2t + 1, what a batch-1
//   specialisation would save; 592 instructions). Only an H100 came (3.034 TB/s, two
//   alternations): base 2239.8 / 2240.1 us, nxr (nx and nr together) 2188.5 / 2189.2 (-51: nx
//   and nr add up), nl 2171.1 / 2174.0 (-67 of nxe - nx, about -105: the loads are most of the `e`
//   part on the H100), no 2237.7 / 2234.1 (-4: not worth a kernel). On the H200, run
//   `VARIANTS="base nxr nl no"` first: if nl is most of nxe's -170 there too, the lever is the
//   scales' and mins' bytes and requests (e.g. stored inside each tile step's weight chunk, or
//   AWQ's integer zero in 4 bits beside an f16 scale: 2.5 bytes a group row instead of 4).
// - The ablations once more on the H100 (3.011 TB/s, three alternations): base 2262.5 / 2256.2 /
//   2254.9 us, nx 2236.5 / 2236.2 / 2231.9, nr 2235.3 / 2237.8 / 2234.2, nxe 2130.2 / 2132.4 /
//   2129.5; bf16 5592.6 / 5589.6 in the same call (2.48x, 85.5% of the 1929 us roofline).
//   Same picture as session 23: the H100 is bound by bytes.
// - L2 prefetch one or two steps past the ring (a knob `TM_Q4_L2_AHEAD` in the tile-major lean
//   loops, removed after): each lane's `prefetch.global.L2` of its own load addresses (4 a gate/up
//   step; silu_lnts spills 8 B at 80 registers), or lane 0's one 1-KiB
//   `cp.async.bulk.prefetch.L2` per tile and step (no spills). H100, 3.027 TB/s: base 2240.3 /
//   2242.1, per-lane A = 1 everywhere 2328.1 / 2315.7, A = 2 2417.6 / 2421.3, A = 1 in gate/up
//   only 2287.7 / 2285.2; 3.022 TB/s: base 2274.6 / 2274.4, bulk A = 1 everywhere 2357.0 / 2361.5,
//   in gate/up only 2330.8 / 2328.2. All slower by 45-180 us (probably the prefetches delay the
//   demand loads that the warps wait on). Like the whole-tile prefetches of sessions 13 and 15,
//   not pursued; not run on the H200 (one H200 call only, spent on the ablations).
//
// Session 25 (2026-12-06; engine only, AWQ 8B b1 replay, f16, scripts/gpu_b1_ab.sh, three
// alternations per call; the base cubin byte-identical to the shipped one):
// - H200 (4.205 TB/s): base 1947.2 / 1946.0 / 1951.1 us, nxr (nx and nr together) 1872.0 /
//   1865.2 / 1868.0 (-79), nl (no scale and min loads) 1837.3 / 1838.8 / 1836.1 (-111); bf16
//   4402.0 / 4405.2: nl would be 2.40x. On the H200 the scale and min loads are most of the
//   `e` part (nxe - nx, -127 in session 24), unlike the H100 (-67 of -105).
// - Scales and mins by shuffle (`TM_Q4_SM_SHFL`, commit f8c4b02, reverted in 442f662: the
//   tile-major loops' lane t of each quad holds step 4 k + t's scale and min words, loaded once
//   per four steps by all lanes, and every step takes its words from lane 4 g + j % 4 with one
//   SHFL per word; the 80-register silu_lnts only when J <= 4): H200 (4.283 TB/s) base 1947.6 /
//   1950.9 / 1948.3, smq 2000.9 / 2003.8 / 2000.3 (+53), smq with nx 1939.4 / 1939.4 / 1939.7, nl
//   1844.0 / 1847.0 / 1846.9; bf16 4420.9 / 4419.1. The shuffles cost more than the loads they
//   replace (both go through the MIO queue; the q4_gemv_bench figures moved by less than their
//   noise, ~0.7 us).
// - H200 (4.278 TB/s): base 1953.3 / 1950.0 / 1945.5 us; scales and mins loaded 2U steps ahead
//   in the U >= 2 tile-major loops (q/k/v, o, down; `TM_Q4_SM_AHEAD` of commit 1a681a1, removed
//   after: a second word set per ring slot, moved into the first after each step; the U = 1
//   silu_lnts spilled with it) 2012.5 / 2016.7 / 2010.0 (+63); in the NT = 2 loops only (gate/up
//   and q/k/v): every step loading step 0's scales and mins (`TM_Q4_ABLATE_SMHIT`: the loads and
//   their conversions stay, their DRAM requests go) 1926.3 / 1925.1 / 1924.4 (-25), no scale and
//   min loads (`TM_Q4_ABLATE_SMLOAD=2`) 1862.2 / 1865.5 / 1864.0 (-86); bf16 4435.2 / 4434.7.
//   So of what the loads cost in those loops, about 30% is their DRAM traffic and latency and
//   70% the per-step instructions: the loads (4 LDG.32 a gate/up step, 8 LDG.U16
//   a q/k/v RoPE step over two row-major tiles) and the conversions after them (per tile and
//   row half: two f16 -> f32 and the FMA for m - OFF s). Fetching them further ahead costs more
//   than it hides. What would cut instructions: the scale and min of a row pair in one 8-byte
//   load (SMI = 1's interleaved words, for every tile-major weight, which q4_gemm.cu would then
//   read too), or a layout whose lane loads two steps' words at once.
// - Built for the next H200 call, which never came (six asks got H100s): `TM_Q4_ABLATE_SMFUSED`
//   (one 16-byte load per lane and step for both tiles' scales and mins in the NT = 2 loops, read
//   at a quarter of the real offset: the loads' count without their bytes), to run as
//   `VARIANTS="base sf nl2"`. Close to nl2 would mean one load per step is the lever (gate and up
//   interleaved per row pair); close to base, the conversions after the loads.
//
// Session 26 (2026-12-06; engine only, AWQ 8B b1 replay, f16, scripts/gpu_b1_ab.sh, two
// alternations; the base cubin byte-identical to the shipped one). Seven asks for an H200: five
// got no machine, one an H100 (stopped at the name check), and the warm H100 then ran the
// variants. New: `TM_Q4_ABLATE_XLOAD` (`xl`: no ones-mma in any lean loop; X of the lane's batch
// columns from one 8-byte L1-hit load a step, what X from the producers would cost the consumers).
// - H100 80GB HBM3 (3.021 TB/s): base 2279.4 / 2273.8 us, sf 2242.8 / 2247.6 (-31), nl2 2224.7 /
//   2220.5 (-54), xl 2253.6 / 2256.2 (-22: the same as nx there, so the load costs about what the
//   ones-mma's removal leaves), sf and xl together 2217.6 / 2216.4 (-60: they add up).
//   So one load a step in the NT = 2 loops gets ~60% of what no loads at all would (sf reads a
//   quarter of the bytes, which flatters it by at most SMHIT's share), and X from the producers
//   loses nothing to its load. The H200 has shown about twice the H100's saving for every
//   ablation so far (nx -43 / -22, nl -111 / -67); if that holds, sf with xl is about -110 to -120
//   there, which is the missing ~105 us. Next: `VARIANTS="base sf xl sfxl"` with BF16=1 on an
//   H200; then build both for real: a scale-and-min layout that gives a lane one 16-byte load per
//   step for the NT = 2 loops (per weight: a row pair's scale and min for two of the warp's steps,
//   loaded every other step; or gate and up interleaved) and X from the producers (f64 atomics).
// - Built since (commit 2609660): tm-core `Int4Layout::TilesAndScalePairs16x128` (`tiled` = 3,
//   scales and mins in one tensor, 8 bytes a row pair and step, 16 bytes for two of a warp's
//   steps), given to gate and up with TM_GATE_UP_SCALE_PAIRS=1 and read by `silu_lntp` with one
//   8-byte load per tile and step (two a gate/up step against silu_lnts' four 4-byte loads; the
//   16-byte load every other step spills 16 B in the 80-register loop, so not built). H100
//   (3.002 TB/s, two alternations, the variant's environment from gpu_b1_ab.sh's env files):
//   base 2276.1 / 2278.2 us, pairs 2282.6 / 2282.4 (+5), xl 2255.3 / 2258.2 (-20), pairs with xl
//   2249.2 / 2248.2 (-8 against xl), sf with xl 2222.5 / 2229.9 (-51); bf16 5701.5 / 5701.8 (base
//   2.50x). So halving the gate/up loads at full bytes gains nothing on the H100: what sf gains
//   there is its single load of both tiles and its quarter of the bytes, which no layout of one
//   weight gives. Left off by default; not run on an H200 (none came).
// Session 27 (2026-12-06; engine only, AWQ 8B b1 replay, f16, two alternations). No H200 again
// (nine asks: five got no machine, three cool-down refusals, one H100); three H100 calls.
// - Full bytes (`TM_Q4_ABLATE_SMFUSED=2`: gate/up's one 16-byte load per lane and step of both
//   tiles' scales and mins, each 16-byte unit of the four tensors read once, as a gate/up
//   interleaved layout would): H100 (3.007 TB/s) base 2277.0 / 2283.1 us, sf 2247.9 / 2248.7
//   (-32), sf2 2276.5 / 2281.4 (-1), sf with xl 2226.9 / 2223.7, sf2 with xl 2248.2 / 2252.7. So on
//   the H100 sf's whole saving is its quarter of the bytes (gate/up's scales and mins are 117 MB a
//   step: three quarters of that at 3 TB/s is 29 us), and fewer load instructions gain nothing:
//   the H100 is bytes-bound here, and no interleaving of gate and up pays there. On the H200 the
//   ablations cost more than their bytes (nl -111 against ~45 us of bytes at 4.8 TB/s), so sf2
//   there is still the open question (`VARIANTS="base sf2"`).
// - X from the producers, built (commits ca3271a, 424ab51; reverted in 8632155): the int4 joins
//   (o, down) and gate/up's SiLU epilogue add each CTA's 16 stored outputs into an f64 per 128
//   columns and batch row of a deferred-norm slot (f64 atomics after the row sums; a third slot
//   per layer for the MLP activation), and every lean consumer (lnt_rope, silu_lnts, down's
//   ln4t_join) loads its two X a step (one double2, __ldca) instead of the ones-mma. Exact block
//   sums (host emulation and conformance), GPU suite green, but H100 (3.009 / 3.038 TB/s): with
//   it 2297.2 / 2302.0 and 2300.4 / 2301.1 us, without (TM_Q4_X_FROM_JOIN=0, same binary)
//   2244.9 / 2242.6 and 2241.0 / 2244.9: +55..+58. Producers' writes alone (consumers still on the
//   mma) 2275.7 / 2269.9 (+30), consumers' reads alone 2288.5 / 2286.4 (+44). So the epilogue's
//   extra reduction, barrier and atomics cost ~0.3 us in each of 96 kernels, and the reads lose
//   where `xl` (one float2 from x, no loop copy) won 20: the double2 and its two F2F.F64 a step,
//   and/or each consumer carrying two loop copies (with and without X). A next try would need
//   f32 X without atomics and one loop per kernel; not worth it on the H100.
// Session 28 (2026-12-06; engine only, AWQ 8B b1 replay, f16, four alternations). Session 27's
// lead, that the X-off build of 424ab51 (`-DTM_Q4_X_FROM_JOIN=0`: three 7232-byte deferred-norm
// slots a layer, unused kernel parameters) ran ~35 us faster than the shipped one, was the hosts:
// A/B'd in one call (gpu_b1_ab.sh running each build's own tm-cli), H100 80GB HBM3 (3.041 TB/s)
// shipped f434833 2237.5 / 2238.6 / 2247.5 / 2242.1 us, X-off build 2246.4 / 2238.9 / 2242.3 /
// 2239.6. Same within noise; the shipped step varies 2238-2283 us between H100 calls.
// - An H100 stand-in for the H200: `q4_gemv_bench --hot` (commit 4a183fd: one L2-resident copy of
//   each weight set, gate/up at 7168 rows a weight), f16, n = 1, --iters 300 --variants ln, three
//   rounds of seven cubins built in one gpu_kernel_variants.sh run (the base one byte-identical to
//   the shipped one); every figure repeated within 0.1 us. H100 80GB HBM3, us, `ops` (the model's
//   launch: silu_lnts for gate/up) and `ln graph`:
//       cubin   q/k/v ops/graph   o ops/graph   gate/up (half) ops   down ops/graph
//       base    5.7 / 5.6         4.5 / 4.7     12.5                 10.3 / 13.3
//       nx      5.3 / 5.1         4.3 / 4.2     12.2                  9.5 / 11.6
//       nr      5.1 / 5.0         4.1 / 4.2     12.3                  9.7 / 11.1
//       nxe     4.8 / 4.6         3.9 / 3.8     11.4                  8.4 / 10.4
//       nl      5.2 / 5.0         4.1 / 4.2     12.0                  9.3 / 11.7
//       sf2     5.7 / 5.5         4.5 / 4.7     12.4                 10.3 / 13.3
//       pairs   5.7 / 5.6         4.5 / 4.7     12.8                 10.4 / 13.5
//   Against session 24's H200 bench (cold, graph, n = 1; base / nx / nr / nxe): the ablations'
//   savings agree to ~0.1-0.3 us per product: down -0.8 / -0.7 / -2.0 on the H200, -0.8 / -0.6 /
//   -1.9 hot on the H100; q/k/v -0.4 / -0.6 / -1.0 and -0.5 / -0.6 / -1.0; o -0.5 / -0.6 / -0.8
//   and -0.5 / -0.5 / -0.9; gate/up -0.9 / -0.5 / -2.2 and, twice the half-size figure, -0.6 /
//   -0.4 / -2.2. The cold runs on the same H100 (base / nl / sf2: gate/up 25.1 / 23.8 / 25.1,
//   down 13.8 / 12.5 / 13.8) show the bytes-bound picture of sessions 23-27. So the H100 with
//   --hot predicts what a kernel change saves on the H200, without one. Its verdicts on the two
//   open H200 questions: sf2 (gate/up's one 16-byte scale-and-min load a step, full bytes) saves
//   nothing (12.4 against 12.5), and the pairs layout (silu_lntp) costs +0.3 us per half gate/up,
//   ~+20 us a step. Neither an interleaved gate/up scale layout nor the pairs layout is worth
//   building or keeping; the next session should remove `TilesAndScalePairs16x128` and
//   `silu_lntp` (with their conformance and host-emulation cases; default cubins must stay
//   byte-identical, `cmp`). What the stand-in says is left: nl (-0.5 / -0.4 / -0.4 / -1.0 a
//   product hot, the per-step scale and min loads and conversions) and nxe's epilogue.
// Session 29 (2026-12-06; no H200: one H100 80GB HBM3, 3.034 TB/s). The pairs layout, `silu_lntp`,
// TM_GATE_UP_SCALE_PAIRS and TM_Q4_ABLATE_SMFUSED removed (commit 4c8040e; every sm_90 cubin
// byte-identical to the build of 2609660^, checked with a kernels build of each source tree).
// - `q4_gemv_bench --hot`, f16, n = 1, --iters 300 --variants ln, three rounds (us, ops / ln graph):
//       cubin   q/k/v                   o                       gate/up (half) ops   down
//       base    7.1-7.4 / 6.2-6.3       5.9-6.1 / 4.7-4.8       13.4-13.7            11.7-11.9 / 11.2
//       no      7.1-7.3 / 6.2           5.8-6.0 / 4.7-4.8       13.3-13.5            11.7-11.8 / 11.4-11.5
//       nl      6.5 / 5.7               5.5 / 4.3-4.5           12.8                 10.6 / 9.8-9.9
//   PDL was off in these runs: the kernels directory came from a build of 2609660^'s sources
//   (cubins identical, manifest digest not), so the bench's manifest check launched without
//   programmatic dependent launch; that is why the figures are above session 28's (base 5.7 / 5.6,
//   4.5 / 4.7, 12.5, 10.3 / 13.3). Within the call the variants compare alike: `no`
//   (TM_Q4_ABLATE_ODD_E, what a batch-1 epilogue would save) is -0.1..-0.2 us a product, ~-0.7 us
//   a layer, as on the H100 engine in session 24 (-4 us a step): not worth a kernel. (Cause of the
//   stale build: `cargo xtask` run in a worktree with the main checkout's target dir bakes the
//   worktree's source path into the xtask binary, which the main checkout then reuses; give a
//   worktree its own target dir.)
// - A lead not built (needs an H200 to judge): the scale and the min of a row and group stored
//   as the f32 pair (s, m - OFF s) the lean epilogue computes (bitwise the same sums), one 16-byte
//   load a tile and step for rows g and g + 8, no conversions and no FMA for the min: about 7 of
//   nl's 8 instructions a tile and step, for twice the scale-and-min bytes (+6.25% of the weight
//   bytes, ~+218 MB a step for the 8B, up to ~+50 us at the H200's bandwidth). Against nl's -111
//   us (session 25) that nets roughly -45..-70 us: short of the -110 that 2.4x needs on its own.
// Session 31 (2026-12-07): the batch-1 loop (q4_gemv.cu's TM_Q4_LEAN_B1, `q4_tiles_lean_loop`'s
// B1). At n = 1 the mmas' batch columns 1..7 are discarded, so the lanes g >= 1 that feed them
// may feed anything: each lane loads its x chunk 0 from 16-byte block g / 2, and ONE ones-mma with
// B = words 2g, 2g + 1 of every lane's 32 columns sums all 128 x of the step (eight before); each
// lane's share of X is its fragment's c0 + c1, and its min term (m - OFF s) times that share goes
// into the unused column-1 element, summed over the quad once after the loop. With that, f16's
// high nibbles need no shift (q4_gemv.cu `raw4`'s HI4: 64 + q under the magic 0x5400): lanes
// t = 0, 1 hold the ones-mma columns fed with the low nibbles' x, t = 2, 3 the high ones', so the
// offset is a lane constant (1024 or 64) at no cost (=2). In the general loop the same trick
// needs X and X' in rows
// g and g + 8 of the ones-mma, two A tuples: the 80-register silu_lnts then rematerialises them
// and spills (252 -> 255 SASS instructions a step): not kept. SASS per loop iteration, base / =1
// / =2: silu_lnts 252 / 231 / 198, ln4t_join (two steps) 287 / 278 / 248, lnt_rope 482 / 451 /
// 386; no spills on sm_90 (sm_80/87 spill 8-80 B in several kernels: the default stays 0 there).
// Host emulation (both loops) and the GPU suite with the =2 cubin (H100: 82/29/15 passed).
// q4_gemv_bench --hot, f16, n = 1, --iters 300 --variants ln, H100 80GB HBM3, PDL on, two rounds
// (us, ops / ln graph / ln chain):
//       cubin   q/k/v                    o                    gate/up (half) ops   down
//       base    5.7-5.8 / 5.6 / 5.1-5.2  4.5 / 4.7 / 4.1      12.5                 10.4 / 13.3 / 10.4-10.5
//       =1      5.4 / 5.2 / 4.7          4.3 / 4.1 / 3.3-3.5  12.2                 9.9-10.0 / 11.9 / 9.4
//       =2      5.2-5.3 / 5.1 / 4.4      4.1 / 4.1 / 3.4      12.1                 9.5 / 10.9-11.0 / 9.0-9.2
// =2 saves ~2.6 us a layer (ops), about session 28's `nl` (2.9), which saved 111 us a step on the
// H200 engine (session 25). Shipped as the sm_90 default.
// Session 32 (2026-12-07; one H100 80GB HBM3, 3.023 TB/s, PDL on; no H200 came in eight asks).
// TM_Q4_LEAN_WSWAP (q4_gemv.cu): the tile-major NT = 1 lean loops (o, down) pair each packed
// word's nibbles by column with two PRMTs (bytes (b0, b0, b1, b1) and (b2, b2, b3, b3)) and take
// the x words as loaded, instead of four PRMTs a k picking the x pairs: the PRMT count is the
// same at NT = 1 (two words a k), the shifts go (HI4's one a word; otherwise three become
// two). ln4t_join's loop (two steps) 248 -> 233 SASS instructions at batch 1 on sm_90, 284 -> 268
// in the general loop, 316 -> 300 on sm_80; not at NT = 2 (more PRMTs) nor row-major (`ln`,
// `ln_rope` spill more). One call (target/carry/go11.sh: gpu_b1_ab.sh with VARIANTS="ws b2",
// BF16=1, GEMV_BENCH = q4_gemv_bench --dtype f16 --n 1 --iters 300 --variants ln --hot, one run
// each): us, ops / ln graph / ln chain
//       cubin   q/k/v              o                  gate/up (half) ops   down
//       b2      5.3 / 5.1 / 4.4    4.1 / 4.2 / 3.6    12.2                 9.5 / 11.0 / 9.1
//       ws      5.2 / 5.0 / 4.5    4.0 / 4.1 / 3.5    12.1                 9.3 / 10.6 / 9.0
// Engine AWQ 8B b1 replay, alternated: ws 2247.0 / 2249.4, b2 2249.5 / 2249.6 (within noise);
// bf16 5700.4 / 5701.9 in the same call: 2.54x, 85.5% of the 1921.8 us roofline (5809.6 MB at
// 3.023 TB/s). GPU suite with the ws cubin: 82 / 29 / 15 passed. Shipped (default 1).
// Session 33 (2026-12-07; eleven device calls, every one an H100 80GB HBM3). Session 32's lead
// (a), o and down with tile-ordered scales and mins like gate/up, built and measured, not landed:
// `lnts`/`ln4ts` and their `_join` forms (q4_gemv.cu's LEAN_TILED_TS for NT = 1, SMI = 2), a tm-core
// hook `Ops::prepare_residual_product` for o and down (the CUDA backend reordering their scales as
// `tile_gate_up_scales` does; TM_O_DOWN_TILED_SCALES=0 to compare), host emulation 430 cases with 0
// failures (the scales passed in row-major order: 30), conformance bit-identical to the tile-major
// kernels (products, residual, join output, sums), GPU suite 84 / 30 / 15 passed. Under the joins'
// two-CTA launch bounds ptxas gave ln4ts_join 116 registers (ln4t_join 95); capped at 96
// (`__maxnreg__`, so a CTA fits beside two of silu_lnts' under PDL) it spills nothing and its batch-1
// loop is 209 SASS instructions per two steps against 233. Engine, AWQ 8B b1 replay (us, us / us
// alternated; bf16 in the same call):
//   3.038 TB/s: ts (116 registers) 2264.4 / 2262.8, off 2210.4 / 2212.6, b0 (B1 = 0, WSWAP = 0, ts
//     on) 2282.4 / 2291.3; bf16 5577.9 / 5581.0
//   3.037 TB/s: ts (capped at 96) 2259.6 / 2259.2 / 2262.2, off 2217.9 / 2210.9 / 2210.8; bf16
//     5584.7 / 5581.1 (off is the shipped configuration: 2.52x, 86% of the 1913 us roofline)
//   3.038 TB/s: off 2214.4 / 2214.4 / 2217.8, gate/up row-major too (TM_GATE_UP_TILED_SCALES=0)
//     2238.4 / 2240.6 / 2238.8
// So tile-ordered scales help gate/up on the H100 as on the H200 (-24 us; -8..-12 there) but cost
// o and down +45..+52 us, registers or not. q4_gemv_bench misjudged it hot (L2-resident: o ln graph
// 4.1 -> ts 3.8 us, chain 3.6 -> 3.1; down 11.5 -> 10.8, chain 10.9 -> 9.1) and shows it cold
// (o 5.2 / 5.2 graph, 4.2-4.3 chain either way; down graph 12.9 -> 13.3, chain 12.5 -> 13.1): a
// cost of the order in which DRAM sees the scale and min requests (o's and down's tiles read the
// same contiguous 1 / 3.5 KiB of scales either way), which an L2-resident bench cannot see. The
// --hot stand-in of session 28 predicts instruction savings, not access-pattern changes: check
// those cold and in the engine. B1 + WSWAP against the session-30 loops on the engine: -20..-28 us.
// - o's join with all four of its steps a warp in flight (`ln4t_join` at U = 4 for cols <= 4096,
//   128 registers, no spills; down kept at U = 2; an env-gated launcher branch, not kept): H100
//   (3.043 TB/s) 2227.2 / 2234.6 / 2228.6 us against 2213.7 / 2213.6 / 2210.1 (+14..+21), as U = 3
//   and 4 lost for both joins on the H200 in session 15.
// Session 34 (2026-12-07): no H200 again. Sixteen asks for one (gpu_b1_ratio.sh): one got an H100
// (exit 3 in 0.2 s), twelve found no machine (90-180 s of device time each: two kinds tried, or
// the start failed), two came inside the refusal window (15 s each), and the last was refused
// with 389 s left (too little to start one). Where the shipped loops stand on the H200 is an
// estimate only: session 25's base 1946-1951 us (2.27x), less what B1 and WSWAP save there (the
// H100 engine: -20..-28 us; the H200 has shown about twice the H100's saving per instruction cut,
// and =2's cut is about session 28's `nl`, -111 us on the H200 engine): ~1840-1900 us, 2.33-2.40x.
// Session 35 (2026-12-07): no H200 again. Twelve asks (gpu_b1_ratio.sh, kind nvidia-h200): eight
// found no machine (180 s each), three fell inside the refusal window (15 s each), and the last
// got an H100 80GB HBM3 (exit 3), on which the same bundle then ran with REQUIRE_GPU= ROUNDS=2
// (3.033 TB/s): AWQ b1 replay 2224.2 / 2222.3 us, bf16 5591.7 / 5591.0: 2.51x, 86.2% of the
// 1915.5 us roofline (session 33: 2.52x). q4_gemv_bench cold, n = 1 (ops / ln graph / ln chain):
// q/k/v 6.4 / 6.2 / 5.4 us, o 5.6 / 5.2 / 4.3, gate/up 24.2 / 24.2 / 23.6, down 12.9 / 12.8 /
// 12.5. Session 29's lead (b), judged on paper
// and not built: in the B1 loop f16's HI4 makes the min's offset a lane constant (1024 on lanes
// t = 0, 1, 64 on t = 2, 3), so stored f32 pairs (s, m - 1024 s) would still need one FMA per row
// half on every lane (m - off s = stored + (1024 - off) s); they would save the four f16 -> f32
// conversions per tile and step (and one of SMI = 2's two 32-bit loads), for 8 bytes a row and
// group of scale and min instead of 4 (+5.9% of the bytes: 72 against 68 per 64 bytes of
// weights). Session 28's sf2 (fewer scale loads, same bytes) saved nothing on the --hot stand-in,
// so of `nl`'s -111 us on the H200 the instruction part (~70% by session 25's SMHIT split, ~-78)
// is the conversions and the m - OFF s FMAs, of which (b) removes the conversions (4 of 6), while
// its bytes cost about what SMHIT's saved (~+30): roughly -20 us net. Not worth a layout.
// Session 36 (2026-12-07): no H200 again. Sixteen asks (gpu_b1_ratio.sh, kind nvidia-h200,
// 17:41-19:12 UTC): fourteen found no machine or fell in the refusal window (15-180 s each), the
// last two got an H100 80GB HBM3 (exit 3). The second H100 ran the bundle of 575956f (kernels unchanged since
// session 32) with REQUIRE_GPU= ROUNDS=1 (3.039 TB/s): AWQ b1 replay 2224.5 us, bf16 5590.5 / 5587.5:
// 2.51x, 85.9% of the 1911.7 us roofline. q4_gemv_bench cold, n = 1 (ops / ln graph / ln chain):
// q/k/v 6.4 / 6.2 / 5.5 us, o 5.8 / 5.2 / 4.2, gate/up 24.1 / 24.1 / 23.8, down 12.9 / 12.8 / 12.5.
// The suite's conformance (29) and end_to_end (15) passed; tm_cuda_unit ran out of the call's
// limit while NVRTC compiled the embedded modules (60 tests ok, none failed).
// Session 37 (2026-12-07): two asks (gpu_b1_ratio.sh, kind nvidia-h200, 20:31 and ~20:41 UTC):
// the first found no machine (181 s of device time), the second was told no machine is lent for
// the rest of the session. Kernels unchanged; the bundle of 8b42440 is built and waiting.
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <string>
#include <cstring>
#include <cmath>
#include <cuda_runtime.h>
#include "q4_gemv.cu"
#include "elementwise.cu"
// Experiments of 2026-12-01 (session 13; header): the weights staged in shared memory by TMA bulk
// copies or by cp.async, tile loops over tq4's step math.
namespace tmq4 {
// Consumes the loaded words with a few instructions instead of the math (what the access
// pattern alone costs).
template <int NT> __device__ __forceinline__ void fake_math(const uint4 (&w)[NT][2], const uint4 (&xv)[4], float (*acc)[4]) {
    unsigned v = xv[0].x ^ xv[3].w;
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) v ^= w[i][h].x ^ w[i][h].y ^ w[i][h].z ^ w[i][h].w;
    acc[0][0] += __uint_as_float(v & 0x3FFFFFu);
}
// Staged form of `q4_tiles_lean` TILED (sm_90): one thread of the CTA copies the tiles' weights
// into shared memory with TMA bulk copies (`cp.async.bulk`, one per tile and 1024-column chunk,
// 8 KiB each; the tiles' scales and mins, 16 rows x groups each, with chunk 0), so a CTA keeps
// S chunks of every tile in flight without a register per byte; the warps compute from shared
// memory. Chunk c holds steps 8 c .. 8 c + 7, i.e. step c of each warp. With more chunks than
// stages (J > S) the stages are a ring: each warp releases a stage after its step (mbarrier
// `empty`), and thread 0 refills it with chunk c + S once all eight have. The weights of the
// first S chunks are issued before `wait()`. x is loaded at use (L1-cached), before the stage's
// wait. `smem`: `bulk_smem_bytes(NT, S, cols)` bytes of dynamic shared memory, 128-byte aligned.
namespace bulk {
__device__ __forceinline__ unsigned saddr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void init(u64* bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(saddr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void fence_init() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void expect_tx(u64* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(saddr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void arrive(u64* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(saddr(bar)) : "memory");
}
__device__ __forceinline__ void wait(u64* bar, unsigned parity) {
    unsigned done;
    do {
        asm volatile(
            "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(saddr(bar)), "r"(parity)
            : "memory");
    } while (!done);
}
__device__ __forceinline__ u64 evict_first() {
    u64 p;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
    return p;
}
// `bytes` (a multiple of 16) from global `src` to shared `dst` (both 16-byte aligned), completing
// on `bar`'s transaction count.
__device__ __forceinline__ void copy(void* dst, const void* src, unsigned bytes, u64* bar, u64 policy) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::"r"(
            saddr(dst)),
        "l"(src), "r"(bytes), "r"(saddr(bar)), "l"(policy)
        : "memory");
}
}  // namespace bulk

constexpr int BULK_CHUNK = 8192;  // bytes of one tile's 1024-column chunk
__host__ __device__ constexpr int bulk_smem_bytes(int nt, int stages, int cols) {
    return 128 + stages * nt * BULK_CHUNK + nt * 2 * 32 * (cols >> 7);
}

template <class T, int NT, int S, bool MATH = true, class Wait>
__device__ __forceinline__ void q4_tiles_bulk(const Tile* tiles, const T* __restrict__ x, int n, int cols,
                                              float acc[NT][4], unsigned char* smem, Wait wait) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int J = cols >> 10;      // chunks (steps per warp)
    const int groups = cols >> 7;  // group 128
    u64* full = reinterpret_cast<u64*>(smem);
    u64* empty = full + S;
    uint4* stage = reinterpret_cast<uint4*>(smem + 128);
    __half* ssc = reinterpret_cast<__half*>(smem + 128 + S * NT * BULK_CHUNK);  // [NT][16 rows][groups]
    __half* smn = ssc + NT * 16 * groups;
    auto chunk_src = [&](int i, int c) {
        return tiles[i].packed + (i64)(tiles[i].row0 >> 4) * 8 * cols + (i64)c * BULK_CHUNK;
    };
    if (threadIdx.x == 0) {
#pragma unroll
        for (int s = 0; s < S; ++s) {
            bulk::init(full + s, 1);
            bulk::init(empty + s, WARPS);
        }
        bulk::fence_init();
        const u64 pol = bulk::evict_first();
        const unsigned sb = 32 * groups;  // one tile's scales (or mins)
        for (int c = 0; c < S && c < J; ++c) {
            bulk::expect_tx(full + c, NT * (BULK_CHUNK + (c == 0 ? 2 * sb : 0)));
#pragma unroll
            for (int i = 0; i < NT; ++i) {
                if (c == 0) {
                    bulk::copy(ssc + i * 16 * groups, tiles[i].scales + (i64)tiles[i].row0 * groups, sb, full, pol);
                    bulk::copy(smn + i * 16 * groups, tiles[i].mins + (i64)tiles[i].row0 * groups, sb, full, pol);
                }
                bulk::copy(stage + (c * NT + i) * (BULK_CHUNK / 16), chunk_src(i, c), BULK_CHUNK, full + c, pol);
            }
        }
    }
    __syncthreads();  // the barriers are initialized
    wait();
    zero_acc<NT>(acc);
    const uint4* xp = lean_x_lane(x, n, cols);
    for (int c = 0; c < J; ++c) {
        const int st = c % S;
        const unsigned par = (c / S) & 1;
        uint4 xv[4];
        load_step_x(xv, xp, c);
        bulk::wait(full + st, par);
        const uint4* sp = stage + st * NT * (BULK_CHUNK / 16) + 64 * warp + lane;
        uint4 w[NT][2];
        __half sh[NT][2], mh[NT][2];
#pragma unroll
        for (int i = 0; i < NT; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                w[i][h] = sp[i * (BULK_CHUNK / 16) + 32 * h];
                sh[i][h] = ssc[(i * 16 + g + 8 * h) * groups + warp + 8 * c];
                mh[i][h] = smn[(i * 16 + g + 8 * h) * groups + warp + 8 * c];
            }
        if constexpr (MATH)
            step_math_lean<T, NT>(w, sh, mh, xv, acc);
        else
            fake_math<NT>(w, xv, acc);
        if (c + S < J) {  // the whole CTA: release the stage, thread 0 refills it
            __syncwarp();
            if (lane == 0) bulk::arrive(empty + st);
            if (threadIdx.x == 0) {
                bulk::wait(empty + st, par);
                const u64 pol = bulk::evict_first();
                bulk::expect_tx(full + st, NT * BULK_CHUNK);
#pragma unroll
                for (int i = 0; i < NT; ++i)
                    bulk::copy(stage + (st * NT + i) * (BULK_CHUNK / 16), chunk_src(i, c + S), BULK_CHUNK, full + st,
                               pol);
            }
        }
    }
    __syncthreads();  // shared memory free for the reduction
#else
    __trap();
#endif
}

// EXPERIMENT: `q4_tiles_lean` TILED with the ring in shared memory, filled by cp.async (16 bytes
// per lane and chunk, each lane reading back only what it copied: no barrier), so U steps stay in
// flight through the math without a register per byte. The tiles' scales and mins are staged
// once per CTA (one barrier before the first step). `smem`: `async_smem_bytes(NT, U, cols)`.
namespace acp {
__device__ __forceinline__ void copy16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src)
                 : "memory");
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
}  // namespace acp
__host__ __device__ constexpr int async_scale_bytes(int nt, int cols) { return (nt * 2 * 32 * (cols >> 7) + 127) / 128 * 128; }
__host__ __device__ constexpr int async_smem_bytes(int nt, int u, int cols) {
    return async_scale_bytes(nt, cols) + WARPS * u * nt * 2 * 512;
}
template <class T, int U, int NT, class Wait>
__device__ __forceinline__ void q4_tiles_async(const Tile* tiles, const T* __restrict__ x, int n, int cols,
                                               float acc[NT][4], unsigned char* smem, Wait wait) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int J = cols >> 10, groups = cols >> 7;
    __half* ssm = reinterpret_cast<__half*>(smem);  // [NT][scales, mins][16 rows][groups]
    uint4* ring = reinterpret_cast<uint4*>(smem + async_scale_bytes(NT, cols)) + warp * U * NT * 2 * 32 + lane;
    const int per = 2 * groups;  // 16-byte chunks of one tile's scales (or mins)
    for (int q = threadIdx.x; q < NT * 2 * per; q += THREADS) {
        const int a = q / per, c = q - a * per, i = a >> 1;
        const __half* src = ((a & 1) ? tiles[i].mins : tiles[i].scales) + (i64)tiles[i].row0 * groups;
        acp::copy16(ssm + a * 16 * groups + c * 8, src + c * 8);
    }
    acp::commit();
    const uint4* wp[NT];
#pragma unroll
    for (int i = 0; i < NT; ++i)
        wp[i] = reinterpret_cast<const uint4*>(tiles[i].packed + (i64)(tiles[i].row0 >> 4) * 8 * cols) + 64 * warp + lane;
    auto issue = [&](int j, int slot) {
#pragma unroll
        for (int i = 0; i < NT; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h) acp::copy16(ring + (slot * NT * 2 + i * 2 + h) * 32, wp[i] + 32 * h + 512 * j);
        acp::commit();
    };
#pragma unroll
    for (int u = 0; u < U; ++u) {
        if (u < J)
            issue(u, u);
        else
            acp::commit();
    }
    wait();
    zero_acc<NT>(acc);
    const uint4* xp = lean_x_lane(x, n, cols);
    acp::wait<U>();  // the scales' group
    __syncthreads();
    for (int j = 0; j < J; ++j) {
        const int slot = j % U;
        uint4 xv[4];
        load_step_x(xv, xp, j);
        acp::wait<U - 1>();  // step j's group
        uint4 w[NT][2];
        __half sh[NT][2], mh[NT][2];
#pragma unroll
        for (int i = 0; i < NT; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                w[i][h] = ring[(slot * NT * 2 + i * 2 + h) * 32];
                sh[i][h] = ssm[(i * 2 * 16 + g + 8 * h) * groups + warp + 8 * j];
                mh[i][h] = ssm[((i * 2 + 1) * 16 + g + 8 * h) * groups + warp + 8 * j];
            }
        if (j + U < J)
            issue(j + U, slot);
        else
            acp::commit();
        step_math_lean<T, NT>(w, sh, mh, xv, acc);
    }
    __syncthreads();  // shared memory free for the reduction
}

}  // namespace tmq4

// attention.cu is a second translation unit (its helpers clash with elementwise.cu's in one):
//   nvcc ... -o /tmp/q4c scripts/gpu/q4_decode_chain.cu crates/tm-kernels/cuda/attention.cu
#define TM_ATTN_DECL(SUF, T)                                                                                            \
    extern "C" __global__ void attn_decode_d128_##SUF(                                                                 \
        const T* q, const T* k_cache, const T* v_cache, T* out, float* part_o, float* part_ml, unsigned* counters,    \
        const int* q_start, const int* q_len, const int* ctx_len, const int* bt_start, const unsigned* block_tables,  \
        int heads, int kv_heads, int gs, int block_size, float scale_log2, int window, int num_splits, int partition);
TM_ATTN_DECL(f16, __half)
TM_ATTN_DECL(bf16, __nv_bfloat16)

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { fprintf(stderr, "CUDA %s at %d: %s\n", #x, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)

__device__ unsigned hash(unsigned x) { x ^= x >> 16; x *= 0x7feb352d; x ^= x >> 15; x *= 0x846ca68b; x ^= x >> 16; return x; }
__global__ void fill_bytes(unsigned char* p, size_t n, unsigned seed) {
    for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) p[i] = hash(i * 2654435761u + seed) & 0xFF;
}
template <class T> __global__ void fill_x(T* p, size_t n, unsigned seed, float amp) {
    for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        p[i] = tmk::from_float<T>(amp * ((hash(i * 747796405u + seed) & 0xFFFF) / 32768.0f - 1.0f));
}
__global__ void fill_sm(__half* s, __half* m, size_t n, unsigned seed) {
    for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        float sc = 0.0005f + (hash(i + seed) & 0xFF) / 256000.0f;
        s[i] = __float2half(sc);
        m[i] = __float2half(-7.5f * sc);
    }
}

struct W { unsigned char* p; __half* s; __half* m; int rows, cols; unsigned* smi = nullptr; __half* ts = nullptr; __half* tm = nullptr; };
// Mode `smi`: the scales and mins interleaved tile-major (tmq4::Tile::smi's layout).
__global__ void make_smi(unsigned* smi, const __half* s, const __half* m, int rows, int groups) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < (long long)rows * groups; i += (long long)gridDim.x * blockDim.x) {
        const int r = (int)(i / groups), gr = (int)(i % groups);
        const long long at = (((long long)(r >> 4) * groups + gr) * 8 + (r & 7)) * 2 + ((r >> 3) & 1);
        smi[at] = (unsigned)__half_as_ushort(s[i]) | ((unsigned)__half_as_ushort(m[i]) << 16);
    }
}
// The scales and mins each in tile-major order (q4_tiles_lean's SMI = 2).
__global__ void make_tm(__half* ts, __half* tm, const __half* s, const __half* m, int rows, int groups) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < (long long)rows * groups; i += (long long)gridDim.x * blockDim.x) {
        const int r = (int)(i / groups), gr = (int)(i % groups);
        const long long at = (((long long)(r >> 4) * groups + gr) * 8 + (r & 7)) * 2 + ((r >> 3) & 1);
        ts[at] = s[i];
        tm[at] = m[i];
    }
}
static void add_smi(W& w) {
    CK(cudaMalloc(&w.smi, (size_t)w.rows * (w.cols / 128) * 4));
    make_smi<<<256, 256>>>(w.smi, w.s, w.m, w.rows, w.cols / 128);
    CK(cudaMalloc(&w.ts, (size_t)w.rows * (w.cols / 128) * 2));
    CK(cudaMalloc(&w.tm, (size_t)w.rows * (w.cols / 128) * 2));
    make_tm<<<256, 256>>>(w.ts, w.tm, w.s, w.m, w.rows, w.cols / 128);
}
static W make_w(int rows, int cols, unsigned seed) {
    W w{nullptr, nullptr, nullptr, rows, cols};
    size_t pb = (size_t)rows * cols / 2, ng = (size_t)rows * (cols / 128);
    CK(cudaMalloc(&w.p, pb)); CK(cudaMalloc(&w.s, ng * 2)); CK(cudaMalloc(&w.m, ng * 2));
    fill_bytes<<<1024, 256>>>(w.p, pb, seed);
    fill_sm<<<256, 256>>>(w.s, w.m, ng, seed * 7 + 1);
    return w;
}
struct Layer { W q, k, v, o, gate, up, down; };

template <class... A> static void launch(void (*f)(A...), dim3 grid, int threads, size_t smem, cudaStream_t st, A... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid; cfg.blockDim = dim3(threads); cfg.dynamicSmemBytes = smem; cfg.stream = st;
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = at; cfg.numAttrs = 1;
    CK(cudaLaunchKernelEx(&cfg, f, args...));
}

// gate/up+SiLU on tile-major weights with U steps in flight per warp and x loaded at use, two
// CTAs per SM (mode `g4`; silu_lnt is U = 2, silu_ln4t U = 4 with x buffered at one CTA per SM).
#define SILU_X(NAME, T, U, XPRE) TM_Q4_GEMV_SILU_X(NAME, T, U, 2, LEAN_TILED, XPRE)
SILU_X(silu_t3a_f16, __half, 3, false)
SILU_X(silu_t4a_f16, __half, 4, false)
SILU_X(silu_t3a_bf16, __nv_bfloat16, 3, false)
SILU_X(silu_t4a_bf16, __nv_bfloat16, 4, false)

// Mode `bk`: the products with their weights staged in shared memory by TMA bulk copies
// (`tmq4::q4_tiles_bulk`, sm_90): gate/up+SiLU (16-row CTAs, all four 1024-column chunks of both
// tiles in flight, 3 CTAs per SM) and plain products of one weight (16-row CTAs, an S-stage ring).
template <class T, int S>
__global__ void __launch_bounds__(256, 3) silu_bulk(T* out, const T* __restrict__ x, int n, int cols,
                                                   const unsigned char* wg, const __half* sg, const __half* mg,
                                                   const unsigned char* wu, const __half* su, const __half* mu, int rows) {
    extern __shared__ __align__(128) unsigned char sm[];
    const int row0 = blockIdx.x * 16;
    const tmq4::Tile tiles[2] = {tmq4::Tile{wg, sg, mg, row0, rows}, tmq4::Tile{wu, su, mu, row0, rows}};
    float acc[2][4];
    tmq4::q4_tiles_bulk<T, 2, S>(tiles, x, n, cols, acc, sm, [] { tmk::pdl_wait(); });
    tmq4::trigger_after_loop();
    float* red = reinterpret_cast<float*>(sm + 128);
    float* upv = red + tmq4::WARPS * 2 * 4 * 32;
    tmq4::silu_store<T>(out, tmq4::reduce_warps_in<2>(red, acc), upv, row0, rows, n);
}
template <class T, int S>
__global__ void __launch_bounds__(256, 3) plain_bulk(const T* __restrict__ x, int n, int cols, T* out,
                                                    const unsigned char* w, const __half* sc, const __half* mn, int rows) {
    extern __shared__ __align__(128) unsigned char sm[];
    const tmq4::Tile tile{w, sc, mn, (int)blockIdx.x * 16, rows};
    float acc[1][4];
    tmq4::q4_tiles_bulk<T, 1, S>(&tile, x, n, cols, acc, sm, [] { tmk::pdl_wait(); });
    tmq4::trigger_after_loop();
    const float v = tmq4::reduce_warps_in<1>(reinterpret_cast<float*>(sm + 128), acc);
    if (threadIdx.x < 128) {
        const int e = threadIdx.x >> 5, lane = threadIdx.x & 31;
        const int row = tile.row0 + (lane >> 2) + 8 * (e >> 1);
        const int j = 2 * (lane & 3) + (e & 1);
        if (j < n) out[(i64)j * rows + row] = tmk::from_float<T>(v);
    }
}
// `iso` experiment: the loops' loads with the math replaced by an XOR (what the access pattern alone costs).
template <class T, int S, bool BULK>
__global__ void __launch_bounds__(256, BULK ? 3 : 2) silu_nomath(T* out, const T* __restrict__ x, int n, int cols,
                                                   const unsigned char* wg, const __half* sg, const __half* mg,
                                                   const unsigned char* wu, const __half* su, const __half* mu, int rows) {
    extern __shared__ __align__(128) unsigned char sm[];
    const int row0 = blockIdx.x * 16;
    const tmq4::Tile tiles[2] = {tmq4::Tile{wg, sg, mg, row0, rows}, tmq4::Tile{wu, su, mu, row0, rows}};
    float acc[2][4];
    static_assert(BULK, "the lean loop's no-math form needed a hook in q4_tiles_lean (commit of session 13's experiments)");
    tmq4::q4_tiles_bulk<T, 2, S, false>(tiles, x, n, cols, acc, sm, [] { tmk::pdl_wait(); });
    tmq4::trigger_after_loop();
    if (acc[0][0] == 1.2345f) out[blockIdx.x] = tmk::from_float<T>(acc[0][0]);
}
// Persistent gate/up+SiLU: CTA b computes the 16-row tile pairs b, b + G, ... (G = the grid), its
// weights streamed through one S-stage TMA ring that runs on across the tiles (so DRAM stays busy
// through each tile's reduction and epilogue); scales and mins per tile in two slots.
__host__ __device__ constexpr int pers_smem(int S, int cols) {
    return 128 + S * 2 * tmq4::BULK_CHUNK + 2 * 2 * 2 * 32 * (cols >> 7) + (8 * 2 * 4 * 32 + 128) * 4;
}
template <class T, int S, bool EARLY>
__global__ void __launch_bounds__(256, 2) silu_pers(T* out, const T* __restrict__ x, int n, int cols,
                                                   const unsigned char* wg, const __half* sg, const __half* mg,
                                                   const unsigned char* wu, const __half* su, const __half* mu, int rows) {
    using namespace tmq4;
    extern __shared__ __align__(128) unsigned char sm[];
    if (EARLY) tmk::pdl_launch_dependents_early();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int J = cols >> 10, groups = cols >> 7;
    const int sets = rows >> 4;
    const int mine = (sets - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x;
    const int C = mine * J;
    u64* full = reinterpret_cast<u64*>(sm);
    u64* empty = full + S;
    uint4* stage = reinterpret_cast<uint4*>(sm + 128);
    __half* ssc = reinterpret_cast<__half*>(sm + 128 + S * 2 * BULK_CHUNK);  // [slot][tile][16][groups]
    __half* smn = ssc + 2 * 2 * 16 * groups;
    float* red = reinterpret_cast<float*>(smn + 2 * 2 * 16 * groups);
    float* upv = red + WARPS * 2 * 4 * 32;
    const unsigned char* wp[2] = {wg, wu};
    const __half* sp[2] = {sg, su};
    const __half* mp[2] = {mg, mu};
    auto issue = [&](int c, u64 pol) {
        const int p = c / J, j = c - p * J, st = c % S, set = blockIdx.x + p * gridDim.x;
        const unsigned sb = 32 * groups;
        bulk::expect_tx(full + st, 2 * (BULK_CHUNK + (j == 0 ? 2 * sb : 0)));
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            if (j == 0) {
                bulk::copy(ssc + ((p & 1) * 2 + i) * 16 * groups, sp[i] + (i64)set * 16 * groups, sb, full + st, pol);
                bulk::copy(smn + ((p & 1) * 2 + i) * 16 * groups, mp[i] + (i64)set * 16 * groups, sb, full + st, pol);
            }
            bulk::copy(stage + (st * 2 + i) * (BULK_CHUNK / 16), wp[i] + (i64)set * 8 * cols + (i64)j * BULK_CHUNK,
                       BULK_CHUNK, full + st, pol);
        }
    };
    if (threadIdx.x == 0) {
        for (int s = 0; s < S; ++s) {
            bulk::init(full + s, 1);
            bulk::init(empty + s, WARPS);
        }
        bulk::fence_init();
        const u64 pol = bulk::evict_first();
        for (int c = 0; c < S && c < C; ++c) issue(c, pol);
    }
    __syncthreads();
    tmk::pdl_wait();
    const uint4* xp = tmq4::lean_x_lane(x, n, cols);
    float acc[2][4];
    tmq4::zero_acc<2>(acc);
    for (int c = 0; c < C; ++c) {
        const int p = c / J, j = c - p * J, st = c % S;
        const unsigned par = (c / S) & 1;
        uint4 xv[4];
        tmq4::load_step_x(xv, xp, j);
        bulk::wait(full + st, par);
        const uint4* wsp = stage + st * 2 * (BULK_CHUNK / 16) + 64 * warp + lane;
        uint4 w[2][2];
        __half sh[2][2], mh[2][2];
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                w[i][h] = wsp[i * (BULK_CHUNK / 16) + 32 * h];
                const int at = (((p & 1) * 2 + i) * 16 + g + 8 * h) * groups + warp + 8 * j;
                sh[i][h] = ssc[at];
                mh[i][h] = smn[at];
            }
        step_math_lean<T, 2>(w, sh, mh, xv, acc);
        __syncwarp();
        if (lane == 0) bulk::arrive(empty + st);
        if (threadIdx.x == 0 && c + S < C) {
            bulk::wait(empty + st, par);
            issue(c + S, bulk::evict_first());
        }
        if (j == J - 1) {  // tile pair p done: reduce and store
            if (!EARLY && c == C - 1) trigger_after_loop();
            const int row0 = (blockIdx.x + p * gridDim.x) * 16;
            silu_store<T>(out, reduce_warps_in<2>(red, acc), upv, row0, rows, n);
            tmq4::zero_acc<2>(acc);
        }
    }
}
// cp.async-ring forms (tmq4::q4_tiles_async): gate/up+SiLU and plain products of one weight.
template <class T, int U, int MINB>
__global__ void __launch_bounds__(256, MINB) silu_async(T* out, const T* __restrict__ x, int n, int cols,
                                                   const unsigned char* wg, const __half* sg, const __half* mg,
                                                   const unsigned char* wu, const __half* su, const __half* mu, int rows) {
    extern __shared__ __align__(128) unsigned char sm[];
    const int row0 = blockIdx.x * 16;
    const tmq4::Tile tiles[2] = {tmq4::Tile{wg, sg, mg, row0, rows}, tmq4::Tile{wu, su, mu, row0, rows}};
    float acc[2][4];
    tmq4::q4_tiles_async<T, U, 2>(tiles, x, n, cols, acc, sm, [] { tmk::pdl_wait(); });
    tmq4::trigger_after_loop();
    float* red = reinterpret_cast<float*>(sm);
    float* upv = red + tmq4::WARPS * 2 * 4 * 32;
    tmq4::silu_store<T>(out, tmq4::reduce_warps_in<2>(red, acc), upv, row0, rows, n);
}
template <class T, int U, int MINB>
__global__ void __launch_bounds__(256, MINB) plain_async(const T* __restrict__ x, int n, int cols, T* out,
                                                    const unsigned char* w, const __half* sc, const __half* mn, int rows) {
    extern __shared__ __align__(128) unsigned char sm[];
    const tmq4::Tile tile{w, sc, mn, (int)blockIdx.x * 16, rows};
    float acc[1][4];
    tmq4::q4_tiles_async<T, U, 1>(&tile, x, n, cols, acc, sm, [] { tmk::pdl_wait(); });
    tmq4::trigger_after_loop();
    const float v = tmq4::reduce_warps_in<1>(reinterpret_cast<float*>(sm), acc);
    if (threadIdx.x < 128) {
        const int e = threadIdx.x >> 5, lane = threadIdx.x & 31;
        const int row = tile.row0 + (lane >> 2) + 8 * (e >> 1);
        const int j = 2 * (lane & 3) + (e & 1);
        if (j < n) out[(i64)j * rows + row] = tmk::from_float<T>(v);
    }
}
int g_pers = 264;  // grid of the persistent gate/up in the chain (g_bk & 16)
int g_bk = 0;  // bulk-staged kernels: 1 gate/up, 2 down (S = 8), 4 o (S = 4), 8 down with S = 4

// gate/up+SiLU (tile-major, lean) at more CTAs per SM (fewer registers: more warps to hide the
// math's latency): NAME_U<u>m<ctas>[x: x buffered with the weights].
#define SILU_M(NAME, U, MINB, XPRE) TM_Q4_GEMV_SILU_X(NAME##_f16, __half, U, MINB, LEAN_TILED, XPRE) \
    TM_Q4_GEMV_SILU_X(NAME##_bf16, __nv_bfloat16, U, MINB, LEAN_TILED, XPRE)
SILU_M(silu_u2m3, 2, 3, false)
SILU_M(silu_u2m4, 2, 4, false)
SILU_M(silu_u1m4, 1, 4, false)
SILU_M(silu_u1m4x, 1, 4, true)
SILU_M(silu_u3m3, 3, 3, false)
SILU_M(silu_u1m3x, 1, 3, true)
template <class T> struct Ks;
#define KS(SUF, TY) template <> struct Ks<TY> { \
    static constexpr auto ln = q4_gemv_ln_##SUF; static constexpr auto ln4 = q4_gemv_ln4_##SUF; \
    static constexpr auto silu = q4_gemv_silu_ln_##SUF; \
    static constexpr auto tl = q4_gemv_lnt_##SUF; static constexpr auto tl4 = q4_gemv_ln4t_##SUF; \
    static constexpr auto silu_tl = q4_gemv_silu_lnt_##SUF; \
    static constexpr auto silu_t3a = silu_t3a_##SUF; static constexpr auto silu_t4a = silu_t4a_##SUF; \
    static constexpr auto attn = attn_decode_d128_##SUF; \
    static constexpr decltype(&silu_u2m3_##SUF) sm[6] = {silu_u2m3_##SUF, silu_u2m4_##SUF, silu_u1m4_##SUF, silu_u1m4x_##SUF, silu_u3m3_##SUF, silu_u1m3x_##SUF}; \
    static constexpr auto rope = tm_kernel_rope_write_kv_##SUF::rope_write_kv_##SUF; static constexpr auto arn = tm_kernel_add_rms_norm_##SUF::add_rms_norm_##SUF; };
KS(f16, __half)
KS(bf16, __nv_bfloat16)

enum Form { EARLY, LATE, NONE };
const char* form_names[] = {"early", "late", "none"};

// add_rms_norm with the ordinary (late) trigger.
template <class T> __global__ void __launch_bounds__(512) arn_late(T* out, T* resid, const T* x, const T* w, float eps, int rows, int cols) {
    tmk::pdl_wait();
    add_rms_norm_impl<T>(out, resid, x, w, eps, rows, cols);
}
// Stands in for decode attention at batch 1 (72 CTAs busy for `ns` nanoseconds), with or without
// an early trigger.
__global__ void __launch_bounds__(256) att_standin(int early, long long ns, float* sink, const char* pa, const char* pb,
                                                   long long pbytes) {
    if (early) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    // L2 prefetch of pbytes of each of pa and pb (64 KiB bulk prefetches spread over the CTAs)
    if (threadIdx.x == 0 && pbytes > 0) {
        for (long long off = (long long)blockIdx.x * 65536; off < pbytes; off += (long long)gridDim.x * 65536) {
            const unsigned n = (unsigned)min(65536LL, pbytes - off);
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(pa + off), "r"(n) : "memory");
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(pb + off), "r"(n) : "memory");
        }
    }
    tmk::pdl_wait();
    long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
    if (threadIdx.x == 0 && t == 0) sink[blockIdx.x] = 1.f;
}
// Reads two arrays of `n` uint4 each (streaming) and sums their words: the read roofline.
__global__ void __launch_bounds__(256) read_sum(const uint4* a, const uint4* b, long long n, float* sink) {
    tmk::pdl_launch_dependents_early();
    unsigned acc = 0;
    for (long long i = blockIdx.x * 256LL + threadIdx.x; i < n; i += gridDim.x * 256LL) {
        const uint4 u = __ldcs(a + i), v = __ldcs(b + i);
        acc += u.x ^ u.y ^ u.z ^ u.w ^ v.x ^ v.y ^ v.z ^ v.w;
    }
    tmk::pdl_wait();
    if (acc == 0x12345678u) sink[0] = 1.f;
}
int g_rope = 0;  // 1: rope_write_kv after q/k/v (as the engine runs it)
int g_att = 0;  // 0: no stand-in, 1: stand-in, 2: stand-in with an early trigger, 3: attn_decode itself
bool g_at_only = false;
// Decode attention itself (g_att = 3): per layer a paged cache of ACTX keys of 8 KV heads of 128
// in blocks of 64 (one shuffled block table), one sequence, split as the CUDA backend splits it at
// batch 1 (one 64-key tile per split CTA, the last CTA of each head group merging).
constexpr int ACTX = 600, ABLK = 64, APART = 64, ASPLITS = (ACTX + APART - 1) / APART;
struct AttnBufs {
    std::vector<void*> kc, vc;  // per layer
    int* meta;                  // q_start, q_len, ctx_len, bt_start
    unsigned *bt, *cnt;
    float *po, *pml;
    void* out;
};
AttnBufs g_ab;
long long g_pf = 0;    // bytes of the gate and of the up weight the stand-in prefetches into L2
long long g_pf_off = 0;  // from this byte offset
bool g_pf_only = false;
bool g_tl_only = false;
int g_silu = 0;  // gate/up on tile-major weights: 0 silu_lnt, 1 silu_t3a, 2 silu_t4a
bool g_g4_only = false;
int g_tl = 0;  // 1: the tile-major kernels (lnt, ln4t, silu_lnt: the weights read as tile-major)

// Mode `pk` (session 18): an L2 prefetch kernel between q/k/v and attention (`at`'s chain): it
// lets its dependents launch first thing, issues `cp.async.bulk.prefetch.L2` of pk_o bytes of o
// (packed, then scales and mins) and pk_gu bytes of each of gate and up (64 KiB per instruction,
// spread over its CTAs), then waits for q/k/v, so attention's wait still covers q/k/v. pk_on = 0:
// no kernel (the hop's cost is pk_on = 1 with no bytes).
int g_pk_on = 0;
long long g_pk_o = 0, g_pk_gu = 0;
bool g_pk_only = false;
__device__ __forceinline__ void l2_prefetch_range(const char* p, long long bytes, int part, int parts) {
    for (long long off = (long long)part * 65536; off < bytes; off += (long long)parts * 65536) {
        const unsigned n = (unsigned)min(65536LL, bytes - off);
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p + off), "r"(n) : "memory");
    }
}
__global__ void __launch_bounds__(32) l2_prefetch_kernel(const char* o, long long ob, const char* os, const char* om,
                                                         long long osb, const char* g, const char* u, long long gub) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    if (threadIdx.x == 0) {
        l2_prefetch_range(o, ob, blockIdx.x, gridDim.x);
        l2_prefetch_range(os, osb, blockIdx.x, gridDim.x);
        l2_prefetch_range(om, osb, blockIdx.x, gridDim.x);
        l2_prefetch_range(g, gub, blockIdx.x, gridDim.x);
        l2_prefetch_range(u, gub, blockIdx.x, gridDim.x);
    }
    tmk::pdl_wait();
}

// Mode `smi` (session 18): gate/up+SiLU as silu_lnt (U = 1, x with the weights, three CTAs per
// SM), the scales and mins row-major or interleaved (`Tile::smi`); the epilogue written out here.
template <class T, int SMI>
__global__ void __launch_bounds__(256, 3)
    silu_s(T* out, const T* __restrict__ x, int n, int cols, const unsigned char* wg, const __half* sg,
           const __half* mg, const unsigned char* wu, const __half* su, const __half* mu, int rows,
           const unsigned* smig = nullptr, const unsigned* smiu = nullptr) {
    const int row0 = blockIdx.x * 16;
    const tmq4::Tile tiles[2] = {tmq4::Tile{wg, sg, mg, row0, rows, 1, 8, smig}, tmq4::Tile{wu, su, mu, row0, rows, 1, 8, smiu}};
    float acc[2][4];
    tmq4::q4_tiles_lean<T, 1, 2, true, true, SMI>(tiles, x, n, cols, acc, [] { tmk::pdl_wait(); });
    tmq4::trigger_after_loop();
    constexpr int W = 8;
    __shared__ float red[W * 2 * 4 * 32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) red[(warp * 8 + i * 4 + e) * 32 + lane] = acc[i][e];
    __syncthreads();
    for (int idx = threadIdx.x; idx < 128; idx += 32 * W) {
        float gs = 0.f, us = 0.f;
#pragma unroll
        for (int w = 0; w < W; ++w) {
            gs += red[w * 256 + idx];
            us += red[w * 256 + 128 + idx];
        }
        const int e = idx >> 5, ln = idx & 31;
        const int row = row0 + (ln >> 2) + 8 * (e >> 1);
        const int j = 2 * (ln & 3) + (e & 1);
        if (j < n && row < rows) {
            const float gv = tmk::round_to<T>(gs), uv = tmk::round_to<T>(us);
            out[(long long)j * rows + row] = tmk::from_float<T>(gv / (1.f + __expf(-gv)) * uv);
        }
    }
}
// One weight (o, down), 16 rows per CTA, U steps in flight (ln4t_join's loop without the join).
template <class T, int U, int MINB, int SMI>
__global__ void __launch_bounds__(256, MINB) plain_smi(const T* __restrict__ x, int cols, T* out, const unsigned char* w,
                                                      const __half* s, const __half* m, const unsigned* smi, int rows) {
    const tmq4::Tile tile{w, s, m, (int)blockIdx.x * 16, rows, 1, 8, smi};
    float acc[1][4];
    tmq4::q4_tiles_lean<T, U, 1, false, true, SMI>(&tile, x, 1, cols, acc, [] { tmk::pdl_wait(); });
    tmq4::trigger_after_loop();
    const float v = tmq4::reduce_warps<1>(acc);
    if (threadIdx.x < 128) {
        const int e = threadIdx.x >> 5, lane = threadIdx.x & 31;
        const int row = blockIdx.x * 16 + (lane >> 2) + 8 * (e >> 1);
        if (2 * (lane & 3) + (e & 1) == 0) out[row] = tmk::from_float<T>(v);
    }
}
// Harness gate/up (silu_s) and o/down (plain_smi, U = 2, two per SM) by flags: 1 SMI.
// (flag 2: SMI = 2, the scales and mins each tile-major: pass W::ts / W::tm as the scales and mins)
static const __half* S_(const W& w, int f) { return f & 2 ? w.ts : w.s; }
static const __half* M_(const W& w, int f) { return f & 2 ? w.tm : w.m; }
template <class T> static auto gu_kern(int f) { return f & 2 ? silu_s<T, 2> : f & 1 ? silu_s<T, 1> : silu_s<T, 0>; }
template <class T> static auto pl_kern(int f) { return f & 2 ? plain_smi<T, 2, 2, 2> : f & 1 ? plain_smi<T, 2, 2, 1> : plain_smi<T, 2, 2, 0>; }
// q/k/v as lnt_rope runs it without the RoPE (two 16-row tiles per CTA, U = 2, x at use, two CTAs
// per SM): CTAs 0..127 q, 128..159 k, 160..191 v (outputs not stored: timing only).
template <class T, bool SMI>
__global__ void __launch_bounds__(256, 2) qkv2(const T* __restrict__ x, T* out, const unsigned char* wq, const __half* sq,
                                              const __half* mq, const unsigned* iq, const unsigned char* wk,
                                              const __half* sk, const __half* mk, const unsigned* ik,
                                              const unsigned char* wv, const __half* sv, const __half* mv,
                                              const unsigned* iv) {
    int c = blockIdx.x;
    const unsigned char* w = wq; const __half* sc = sq; const __half* mn = mq; const unsigned* ii = iq; int rows = 4096;
    if (c >= 128) { c -= 128; w = wk; sc = sk; mn = mk; ii = ik; rows = 1024; }
    if (c >= 32) { c -= 32; w = wv; sc = sv; mn = mv; ii = iv; }
    const tmq4::Tile tiles[2] = {tmq4::Tile{w, sc, mn, 32 * c, rows, 1, 8, ii}, tmq4::Tile{w, sc, mn, 32 * c + 16, rows, 1, 8, ii}};
    float acc[2][4];
    tmq4::q4_tiles_lean<T, 2, 2, false, true, SMI>(tiles, x, 1, 4096, acc, [] { tmk::pdl_wait(); });
    tmq4::trigger_after_loop();
    const float v = tmq4::reduce_warps<2>(acc);
    if (threadIdx.x < 8 && v == 12345.f) out[blockIdx.x] = tmk::from_float<T>(v);
}
// chain: 0 = shipped kernels; else 16 + gate/up flags + 4 * o/down flags (harness kernels); 32:
// gate/up = silu_lnt; 64: q/k/v = qkv2 (128: with smi)
int g_smi = 0;
bool g_smi_only = false;

template <class T> struct Bufs {
    T *resid, *delta, *normed, *q, *k, *v, *act, *gamma, *kc, *vc;
    float *sink, *inv_freq;
    unsigned *pos, *slot;
};

template <class T> static void join(Form form, Bufs<T>& b, cudaStream_t st) {
    const int H = 4096;
    const float eps = 1e-5f;
    if (form == EARLY) launch(Ks<T>::arn, 1, 512, 0, st, b.normed, b.resid, (const T*)b.delta, (const T*)b.gamma, eps, 1, H);
    if (form == LATE) launch(arn_late<T>, 1, 512, 0, st, b.normed, b.resid, (const T*)b.delta, (const T*)b.gamma, eps, 1, H);
}

template <class T> static void step(const std::vector<Layer>& Ls, Bufs<T>& b, Form form, cudaStream_t st) {
    const int H = 4096, F = 14336;
    const T* nul = nullptr;
    for (const Layer& L : Ls) {
        join(form, b, st);
        if (g_smi & 64)
            launch(g_smi & 128 ? qkv2<T, true> : qkv2<T, false>, 192, 256, 0, st, (const T*)b.normed, b.v,
                   (const unsigned char*)L.q.p, (const __half*)L.q.s, (const __half*)L.q.m, (const unsigned*)L.q.smi,
                   (const unsigned char*)L.k.p, (const __half*)L.k.s, (const __half*)L.k.m, (const unsigned*)L.k.smi,
                   (const unsigned char*)L.v.p, (const __half*)L.v.s, (const __half*)L.v.m, (const unsigned*)L.v.smi);
        else
        launch(g_tl ? Ks<T>::tl : Ks<T>::ln, 384, 256, 0, st, (const T*)b.normed, 1, H, 128, b.q, b.k, b.v, (const unsigned char*)L.q.p,
               (const unsigned char*)L.k.p, (const unsigned char*)L.v.p, (const __half*)L.q.s, (const __half*)L.k.s,
               (const __half*)L.v.s, (const __half*)L.q.m, (const __half*)L.k.m, (const __half*)L.v.m, nul, nul, nul,
               4096, 1024, 1024);
        if (g_rope)
            launch(Ks<T>::rope, dim3(1, 10), 256, 512, st, b.q, b.k, (const T*)b.v, b.kc, b.vc, (const unsigned*)b.pos,
                   (const unsigned*)b.slot, (const float*)b.inv_freq, 1.0f, 1, 32, 8, 128, 0);
        if (g_att && g_att < 3)
            launch(att_standin, 72, 256, 0, st, g_att == 2 ? 1 : 0, 6000LL, b.sink, (const char*)L.gate.p + g_pf_off,
                   (const char*)L.up.p + g_pf_off, g_pf);
        const T* ox = b.q;  // o's input: attention's output, or q standing in for it
        if (g_pk_on)
            launch(l2_prefetch_kernel, 16, 32, 0, st, (const char*)L.o.p, g_pk_o ? 4096LL * 4096 / 2 : 0LL,
                   (const char*)L.o.s, (const char*)L.o.m, g_pk_o ? 4096LL * 32 * 2 : 0LL, (const char*)L.gate.p,
                   (const char*)L.up.p, g_pk_gu);
        if (g_att == 3) {
            const size_t li = &L - &Ls[0];
            const AttnBufs& a = g_ab;
            launch(Ks<T>::attn, dim3(ASPLITS, 8, 1), 128, (16 + 64) * 136 * sizeof(T) * 1 + 64 * 136 * sizeof(T), st,
                   (const T*)b.q, (const T*)a.kc[li], (const T*)a.vc[li], (T*)a.out, a.po, a.pml, a.cnt,
                   (const int*)a.meta, (const int*)a.meta + 1, (const int*)a.meta + 2, (const int*)a.meta + 3,
                   (const unsigned*)a.bt, 32, 8, 4, ABLK, 1.4426950f / sqrtf(128.f), 0, ASPLITS, APART);
            ox = (const T*)a.out;
        }
        if (g_bk & 128)
            launch(plain_async<T, 4, 2>, 256, 256, tmq4::async_smem_bytes(1, 4, H), st, ox, 1, H, b.delta,
                   (const unsigned char*)L.o.p, (const __half*)L.o.s, (const __half*)L.o.m, 4096);
        else if (g_bk & 4)
            launch(plain_bulk<T, 4>, 256, 256, tmq4::bulk_smem_bytes(1, 4, H), st, ox, 1, H, b.delta,
                   (const unsigned char*)L.o.p, (const __half*)L.o.s, (const __half*)L.o.m, 4096);
        else if (g_smi)
            launch(pl_kern<T>((g_smi >> 2) & 3), 256, 256, 0, st, ox, H, b.delta,
                   (const unsigned char*)L.o.p, S_(L.o, g_smi >> 2), M_(L.o, g_smi >> 2), (const unsigned*)L.o.smi, 4096);
        else
        launch(g_tl ? Ks<T>::tl4 : Ks<T>::ln4, 256, 256, 0, st, ox, 1, H, 128, b.delta, (T*)nullptr, (T*)nullptr,
               (const unsigned char*)L.o.p, (const unsigned char*)nullptr, (const unsigned char*)nullptr,
               (const __half*)L.o.s, (const __half*)nullptr, (const __half*)nullptr, (const __half*)L.o.m,
               (const __half*)nullptr, (const __half*)nullptr, nul, nul, nul, 4096, 0, 0);
        join(form, b, st);
        auto silu = !g_tl ? Ks<T>::silu : g_silu >= 3 ? Ks<T>::sm[g_silu - 3] : g_silu == 1 ? Ks<T>::silu_t3a : g_silu == 2 ? Ks<T>::silu_t4a : Ks<T>::silu_tl;
        if (g_bk & 32)
            launch(silu_async<T, 4, 2>, 896, 256, tmq4::async_smem_bytes(2, 4, H), st, b.act, (const T*)b.normed, 1, H,
                   (const unsigned char*)L.gate.p, (const __half*)L.gate.s, (const __half*)L.gate.m,
                   (const unsigned char*)L.up.p, (const __half*)L.up.s, (const __half*)L.up.m, F);
        else if (g_bk & 16)
            launch(silu_pers<T, 4, false>, g_pers, 256, pers_smem(4, H), st, b.act, (const T*)b.normed, 1, H,
                   (const unsigned char*)L.gate.p, (const __half*)L.gate.s, (const __half*)L.gate.m,
                   (const unsigned char*)L.up.p, (const __half*)L.up.s, (const __half*)L.up.m, F);
        else if (g_bk & 1)
            launch(silu_bulk<T, 4>, 896, 256, tmq4::bulk_smem_bytes(2, 4, H), st, b.act, (const T*)b.normed, 1, H,
                   (const unsigned char*)L.gate.p, (const __half*)L.gate.s, (const __half*)L.gate.m,
                   (const unsigned char*)L.up.p, (const __half*)L.up.s, (const __half*)L.up.m, F);
        else if (g_smi && !(g_smi & 32))
            launch(gu_kern<T>(g_smi & 3), 896, 256, 0, st, b.act, (const T*)b.normed, 1, H,
                   (const unsigned char*)L.gate.p, S_(L.gate, g_smi), M_(L.gate, g_smi),
                   (const unsigned char*)L.up.p, S_(L.up, g_smi), M_(L.up, g_smi), F, (const unsigned*)L.gate.smi,
                   (const unsigned*)L.up.smi);
        else
        launch(silu, 896, 256, 0, st, b.act, (const T*)b.normed, 1, H, 128, (const unsigned char*)L.gate.p,
               (const __half*)L.gate.s, (const __half*)L.gate.m, (const unsigned char*)L.up.p, (const __half*)L.up.s,
               (const __half*)L.up.m, F, (const double*)nullptr, 0.f);
        if (g_bk & 64)
            launch(plain_async<T, 4, 2>, 256, 256, tmq4::async_smem_bytes(1, 4, F), st, (const T*)b.act, 1, F, b.delta,
                   (const unsigned char*)L.down.p, (const __half*)L.down.s, (const __half*)L.down.m, 4096);
        else if (g_bk & 10)
            launch(g_bk & 8 ? plain_bulk<T, 4> : plain_bulk<T, 8>, 256, 256, tmq4::bulk_smem_bytes(1, g_bk & 8 ? 4 : 8, F),
                   st, (const T*)b.act, 1, F, b.delta, (const unsigned char*)L.down.p, (const __half*)L.down.s,
                   (const __half*)L.down.m, 4096);
        else if (g_smi)
            launch(pl_kern<T>((g_smi >> 2) & 3), 256, 256, 0, st, (const T*)b.act, F, b.delta,
                   (const unsigned char*)L.down.p, S_(L.down, g_smi >> 2), M_(L.down, g_smi >> 2), (const unsigned*)L.down.smi, 4096);
        else
        launch(g_tl ? Ks<T>::tl4 : Ks<T>::ln4, 256, 256, 0, st, (const T*)b.act, 1, F, 128, b.delta, (T*)nullptr, (T*)nullptr,
               (const unsigned char*)L.down.p, (const unsigned char*)nullptr, (const unsigned char*)nullptr,
               (const __half*)L.down.s, (const __half*)nullptr, (const __half*)nullptr, (const __half*)L.down.m,
               (const __half*)nullptr, (const __half*)nullptr, nul, nul, nul, 4096, 0, 0);
    }
}

// Reference for the checks: one thread per row, f32, tile-major weights dequantized as stored.
template <class T>
__global__ void ref_gemv(const T* x, int cols, const unsigned char* w, const __half* sc, const __half* mn, int rows, float* out) {
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    float acc = 0.f;
    for (int blk = 0; blk < cols / 32; ++blk) {
        const unsigned char* p = w + tmk::q4_chunk_offset(r, blk, cols, 1);
        const float s = __half2float(sc[(long long)r * (cols / 128) + blk / 4]), m = __half2float(mn[(long long)r * (cols / 128) + blk / 4]);
        for (int b = 0; b < 16; ++b) {
            acc += ((p[b] & 15) * s + m) * tmk::to_float(x[32 * blk + b]);
            acc += ((p[b] >> 4) * s + m) * tmk::to_float(x[32 * blk + 16 + b]);
        }
    }
    out[r] = acc;
}
bool g_bk_only = false;
bool g_sm_only = false;  // mode sm: the gate/up variants of SILU_M in the chain
static bool g_v_only = false;  // mode `v`: `iso`'s shipped gate/up and down only
// The bulk kernels against the lean ones on layer 0's gate/up and down (x random): same math and
// order, so the outputs must be bitwise equal. Also sets the kernels' shared-memory limits.
template <class T> static void check_bulk(const Layer& L, Bufs<T>&) {
    const int H = 4096, F = 14336;
    CK(cudaFuncSetAttribute(silu_bulk<T, 4>, cudaFuncAttributeMaxDynamicSharedMemorySize, tmq4::bulk_smem_bytes(2, 4, H)));
    CK(cudaFuncSetAttribute(plain_bulk<T, 4>, cudaFuncAttributeMaxDynamicSharedMemorySize, tmq4::bulk_smem_bytes(1, 4, F)));
    CK(cudaFuncSetAttribute(plain_bulk<T, 8>, cudaFuncAttributeMaxDynamicSharedMemorySize, tmq4::bulk_smem_bytes(1, 8, F)));
    CK(cudaFuncSetAttribute(plain_bulk<T, 2>, cudaFuncAttributeMaxDynamicSharedMemorySize, tmq4::bulk_smem_bytes(1, 2, F)));
    CK(cudaFuncSetAttribute(silu_bulk<T, 2>, cudaFuncAttributeMaxDynamicSharedMemorySize, tmq4::bulk_smem_bytes(2, 2, H)));
    T *x, *a0, *a1, *d0, *d1;
    for (T** p : {&x, &a0, &a1, &d0, &d1}) CK(cudaMalloc(p, F * sizeof(T)));
    fill_x<T><<<64, 256>>>(x, H, 77, 1.0f);
    cudaStream_t st = 0;
    const T* nul = nullptr;
    launch(Ks<T>::silu_tl, 896, 256, 0, st, a0, (const T*)x, 1, H, 128, (const unsigned char*)L.gate.p,
           (const __half*)L.gate.s, (const __half*)L.gate.m, (const unsigned char*)L.up.p, (const __half*)L.up.s,
           (const __half*)L.up.m, F, (const double*)nullptr, 0.f);
    launch(silu_bulk<T, 4>, 896, 256, tmq4::bulk_smem_bytes(2, 4, H), st, a1, (const T*)x, 1, H,
           (const unsigned char*)L.gate.p, (const __half*)L.gate.s, (const __half*)L.gate.m,
           (const unsigned char*)L.up.p, (const __half*)L.up.s, (const __half*)L.up.m, F);
    launch(Ks<T>::tl4, 256, 256, 0, st, (const T*)a0, 1, F, 128, d0, (T*)nullptr, (T*)nullptr,
           (const unsigned char*)L.down.p, (const unsigned char*)nullptr, (const unsigned char*)nullptr,
           (const __half*)L.down.s, (const __half*)nullptr, (const __half*)nullptr, (const __half*)L.down.m,
           (const __half*)nullptr, (const __half*)nullptr, nul, nul, nul, 4096, 0, 0);
    CK(cudaDeviceSynchronize());
    std::vector<T> h0(F), h1(F);
    auto cmp = [&](const char* what, T* p0, T* p1, int cnt) {
        CK(cudaMemcpy(h0.data(), p0, cnt * sizeof(T), cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(h1.data(), p1, cnt * sizeof(T), cudaMemcpyDeviceToHost));
        int bad = 0; double mx = 0;
        for (int i = 0; i < cnt; ++i) {
            const float u = (float)h0[i], v = (float)h1[i];
            if (memcmp(&h0[i], &h1[i], sizeof(T)) != 0) ++bad;
            mx = fmax(mx, fabs(u - v));
            if (bad == 1 && memcmp(&h0[i], &h1[i], sizeof(T)) != 0) printf("  first mismatch at %d: %g vs %g\n", i, u, v);
        }
        printf("check %s: %d of %d differ (max |diff| %g), sample %g %g\n", what, bad, cnt, mx, (float)h0[7], (float)h0[cnt - 1]);
    };
    cmp("gate/up bulk vs silu_lnt", a0, a1, F);
    CK(cudaFuncSetAttribute(silu_pers<T, 4, false>, cudaFuncAttributeMaxDynamicSharedMemorySize, pers_smem(4, H)));
    CK(cudaFuncSetAttribute(silu_pers<T, 4, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, pers_smem(4, H)));
    CK(cudaFuncSetAttribute(silu_async<T, 4, 2>, cudaFuncAttributeMaxDynamicSharedMemorySize, tmq4::async_smem_bytes(2, 4, H)));
    CK(cudaFuncSetAttribute(silu_async<T, 4, 3>, cudaFuncAttributeMaxDynamicSharedMemorySize, tmq4::async_smem_bytes(2, 4, H)));
    CK(cudaFuncSetAttribute(silu_async<T, 6, 2>, cudaFuncAttributeMaxDynamicSharedMemorySize, tmq4::async_smem_bytes(2, 6, H)));
    CK(cudaFuncSetAttribute(plain_async<T, 4, 2>, cudaFuncAttributeMaxDynamicSharedMemorySize, tmq4::async_smem_bytes(1, 4, F)));
    CK(cudaFuncSetAttribute(plain_async<T, 8, 2>, cudaFuncAttributeMaxDynamicSharedMemorySize, tmq4::async_smem_bytes(1, 8, F)));
    CK(cudaFuncSetAttribute(plain_async<T, 4, 3>, cudaFuncAttributeMaxDynamicSharedMemorySize, tmq4::async_smem_bytes(1, 4, F)));
    CK(cudaMemset(a1, 0, F * sizeof(T)));
    launch(silu_async<T, 4, 2>, 896, 256, tmq4::async_smem_bytes(2, 4, H), st, a1, (const T*)x, 1, H,
           (const unsigned char*)L.gate.p, (const __half*)L.gate.s, (const __half*)L.gate.m,
           (const unsigned char*)L.up.p, (const __half*)L.up.s, (const __half*)L.up.m, F);
    CK(cudaDeviceSynchronize());
    cmp("gate/up cp.async U=4 vs silu_lnt", a0, a1, F);
    for (int G : {264, 299, 448}) {
        CK(cudaMemset(a1, 0, F * sizeof(T)));
        launch(silu_pers<T, 4, false>, G, 256, pers_smem(4, H), st, a1, (const T*)x, 1, H,
               (const unsigned char*)L.gate.p, (const __half*)L.gate.s, (const __half*)L.gate.m,
               (const unsigned char*)L.up.p, (const __half*)L.up.s, (const __half*)L.up.m, F);
        CK(cudaDeviceSynchronize());
        cmp(G == 264 ? "gate/up persistent G=264 vs silu_lnt" : G == 299 ? "gate/up persistent G=299 vs silu_lnt" : "gate/up persistent G=448 vs silu_lnt", a0, a1, F);
    }
    {  // silu_lnt against the f32 reference (rounded as the kernel rounds)
        float *rg, *ru;
        CK(cudaMalloc(&rg, F * 4)); CK(cudaMalloc(&ru, F * 4));
        ref_gemv<T><<<F / 128, 128>>>(x, H, (const unsigned char*)L.gate.p, L.gate.s, L.gate.m, F, rg);
        ref_gemv<T><<<F / 128, 128>>>(x, H, (const unsigned char*)L.up.p, L.up.s, L.up.m, F, ru);
        CK(cudaDeviceSynchronize());
        std::vector<float> g(F), u(F);
        CK(cudaMemcpy(g.data(), rg, F * 4, cudaMemcpyDeviceToHost)); CK(cudaMemcpy(u.data(), ru, F * 4, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(h0.data(), a0, F * sizeof(T), cudaMemcpyDeviceToHost));
        double mx = 0, mref = 0;
        for (int i = 0; i < F; ++i) {
            const float gv = (float)(T)g[i], uv = (float)(T)u[i];
            const float ref = gv / (1.f + expf(-gv)) * uv;
            mx = fmax(mx, fabs((float)h0[i] - ref)); mref = fmax(mref, fabs(ref));
        }
        printf("check silu_lnt vs f32 reference: max |diff| %g (max |ref| %g)\n", mx, mref);
        CK(cudaFree(rg)); CK(cudaFree(ru));
    }
    for (int s : {4, 8}) {
        CK(cudaMemset(d1, 0, H * sizeof(T)));
        launch(s == 4 ? plain_bulk<T, 4> : plain_bulk<T, 8>, 256, 256, tmq4::bulk_smem_bytes(1, s, F), st, (const T*)a0, 1, F, d1,
               (const unsigned char*)L.down.p, (const __half*)L.down.s, (const __half*)L.down.m, 4096);
        CK(cudaDeviceSynchronize());
        cmp(s == 4 ? "down bulk S=4 vs ln4t" : "down bulk S=8 vs ln4t", d0, d1, H);
    }
    CK(cudaMemset(d1, 0, H * sizeof(T)));
    launch(plain_async<T, 4, 2>, 256, 256, tmq4::async_smem_bytes(1, 4, F), st, (const T*)a0, 1, F, d1,
           (const unsigned char*)L.down.p, (const __half*)L.down.s, (const __half*)L.down.m, 4096);
    CK(cudaDeviceSynchronize());
    cmp("down cp.async U=4 vs ln4t", d0, d1, H);
    for (T* p : {x, a0, a1, d0, d1}) CK(cudaFree(p));
}

// Microseconds per launch of `body(l)` for l = 0..31 captured into one graph (3 warm-up replays,
// 20 timed): what the `iso`, `wq` and `smi` modes time.
template <class F> static double graph_us(cudaStream_t st, F body) {
    cudaGraph_t g; cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    for (int l = 0; l < 32; ++l) body(l);
    CK(cudaStreamEndCapture(st, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    for (int i = 0; i < 3; ++i) CK(cudaGraphLaunch(ge, st));
    cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
    CK(cudaEventRecord(e0, st));
    for (int i = 0; i < 20; ++i) CK(cudaGraphLaunch(ge, st));
    CK(cudaEventRecord(e1, st)); CK(cudaEventSynchronize(e1));
    float ms; CK(cudaEventElapsedTime(&ms, e0, e1));
    CK(cudaGraphExecDestroy(ge)); CK(cudaGraphDestroy(g));
    return 1000.0 * ms / 20 / 32;
}

// Mode `iso`: each product alone, 32 launches (layers 0..31, so nothing stays in L2) in one
// graph, PDL as in the chain: us per launch and the weights' bytes over that.
template <class T> static void iso(const char* dt, const std::vector<Layer>& Ls) {
    const int H = 4096, F = 14336;
    Bufs<T> unused{};
    check_bulk<T>(Ls[0], unused);
    T *x, *y;
    CK(cudaMalloc(&x, F * sizeof(T))); CK(cudaMalloc(&y, F * sizeof(T)));
    fill_x<T><<<64, 256>>>(x, F, 5, 0.5f);
    cudaStream_t st; CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    const T* nul = nullptr;
    const double gu = 2.0 * F * H * (0.5 + 4.0 / 128), dn = (double)F * H * (0.5 + 4.0 / 128);
    auto time = [&](const char* what, double bytes, auto body) {
        const double us = graph_us(st, [&](int l) { body(Ls[l]); });
        printf("%s iso %-28s %6.2f us  %5.2f TB/s\n", dt, what, us, bytes / us / 1e6);
    };
    time("gate/up silu_lnt", gu, [&](const Layer& L) {
        launch(Ks<T>::silu_tl, 896, 256, 0, st, y, (const T*)x, 1, H, 128, (const unsigned char*)L.gate.p,
               (const __half*)L.gate.s, (const __half*)L.gate.m, (const unsigned char*)L.up.p, (const __half*)L.up.s,
               (const __half*)L.up.m, F, (const double*)nullptr, 0.f);
    });
    if (g_v_only) {  // mode `v`: the shipped gate/up and down alone (a kernel build's variant)
        time("down ln4t", dn, [&](const Layer& L) {
            launch(Ks<T>::tl4, 256, 256, 0, st, (const T*)x, 1, F, 128, y, (T*)nullptr, (T*)nullptr,
                   (const unsigned char*)L.down.p, (const unsigned char*)nullptr, (const unsigned char*)nullptr,
                   (const __half*)L.down.s, (const __half*)nullptr, (const __half*)nullptr, (const __half*)L.down.m,
                   (const __half*)nullptr, (const __half*)nullptr, nul, nul, nul, 4096, 0, 0);
        });
        CK(cudaFree(x)); CK(cudaFree(y));
        return;
    }
    time("gate/up bulk S=4", gu, [&](const Layer& L) {
        launch(silu_bulk<T, 4>, 896, 256, tmq4::bulk_smem_bytes(2, 4, H), st, y, (const T*)x, 1, H,
               (const unsigned char*)L.gate.p, (const __half*)L.gate.s, (const __half*)L.gate.m,
               (const unsigned char*)L.up.p, (const __half*)L.up.s, (const __half*)L.up.m, F);
    });
    time("gate/up bulk S=2", gu, [&](const Layer& L) {
        launch(silu_bulk<T, 2>, 896, 256, tmq4::bulk_smem_bytes(2, 2, H), st, y, (const T*)x, 1, H,
               (const unsigned char*)L.gate.p, (const __half*)L.gate.s, (const __half*)L.gate.m,
               (const unsigned char*)L.up.p, (const __half*)L.up.s, (const __half*)L.up.m, F);
    });
    CK(cudaFuncSetAttribute(silu_nomath<T, 2, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, tmq4::bulk_smem_bytes(2, 2, H)));
    CK(cudaFuncSetAttribute(silu_nomath<T, 4, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, tmq4::bulk_smem_bytes(2, 4, H)));
    time("gate/up bulk S=2, no math", gu, [&](const Layer& L) {
        launch(silu_nomath<T, 2, true>, 896, 256, tmq4::bulk_smem_bytes(2, 2, H), st, y, (const T*)x, 1, H,
               (const unsigned char*)L.gate.p, (const __half*)L.gate.s, (const __half*)L.gate.m,
               (const unsigned char*)L.up.p, (const __half*)L.up.s, (const __half*)L.up.m, F);
    });
    time("gate/up bulk S=4, no math", gu, [&](const Layer& L) {
        launch(silu_nomath<T, 4, true>, 896, 256, tmq4::bulk_smem_bytes(2, 4, H), st, y, (const T*)x, 1, H,
               (const unsigned char*)L.gate.p, (const __half*)L.gate.s, (const __half*)L.gate.m,
               (const unsigned char*)L.up.p, (const __half*)L.up.s, (const __half*)L.up.m, F);
    });
    const char* smn[6] = {"gate/up lean U=2 3/SM", "gate/up lean U=2 4/SM", "gate/up lean U=1 4/SM", "gate/up lean U=1 4/SM x buf", "gate/up lean U=3 3/SM", "gate/up lean U=1 3/SM x buf"};
    for (int k = 0; k < 6; ++k)
        time(smn[k], gu, [&](const Layer& L) {
            launch(Ks<T>::sm[k], 896, 256, 0, st, y, (const T*)x, 1, H, 128, (const unsigned char*)L.gate.p,
                   (const __half*)L.gate.s, (const __half*)L.gate.m, (const unsigned char*)L.up.p, (const __half*)L.up.s,
                   (const __half*)L.up.m, F, (const double*)nullptr, 0.f);
        });
    time("down lnt (U=2, 3/SM)", dn, [&](const Layer& L) {
        launch(Ks<T>::tl, 256, 256, 0, st, (const T*)x, 1, F, 128, y, (T*)nullptr, (T*)nullptr,
               (const unsigned char*)L.down.p, (const unsigned char*)nullptr, (const unsigned char*)nullptr,
               (const __half*)L.down.s, (const __half*)nullptr, (const __half*)nullptr, (const __half*)L.down.m,
               (const __half*)nullptr, (const __half*)nullptr, nul, nul, nul, 4096, 0, 0);
    });
    auto gu_async = [&](const char* name, auto kern, int U) {
        time(name, gu, [&](const Layer& L) {
            launch(kern, 896, 256, tmq4::async_smem_bytes(2, U, H), st, y, (const T*)x, 1, H,
                   (const unsigned char*)L.gate.p, (const __half*)L.gate.s, (const __half*)L.gate.m,
                   (const unsigned char*)L.up.p, (const __half*)L.up.s, (const __half*)L.up.m, F);
        });
    };
    gu_async("gate/up cp.async U=4 2/SM", silu_async<T, 4, 2>, 4);
    gu_async("gate/up cp.async U=4 3/SM", silu_async<T, 4, 3>, 4);
    gu_async("gate/up cp.async U=6 2/SM", silu_async<T, 6, 2>, 6);
    auto dn_async = [&](const char* name, auto kern, int U) {
        time(name, dn, [&](const Layer& L) {
            launch(kern, 256, 256, tmq4::async_smem_bytes(1, U, F), st, (const T*)x, 1, F, y,
                   (const unsigned char*)L.down.p, (const __half*)L.down.s, (const __half*)L.down.m, 4096);
        });
    };
    dn_async("down cp.async U=4 2/SM", plain_async<T, 4, 2>, 4);
    dn_async("down cp.async U=4 3/SM", plain_async<T, 4, 3>, 4);
    dn_async("down cp.async U=8 2/SM", plain_async<T, 8, 2>, 8);
    if (false)
    for (int G : {264, 299, 448})
        for (int early = 0; early < 2; ++early) {
            char name[64];
            snprintf(name, sizeof name, "gate/up persistent G=%d%s", G, early ? " early" : "");
            time(name, gu, [&](const Layer& L) {
                launch(early ? silu_pers<T, 4, true> : silu_pers<T, 4, false>, G, 256, pers_smem(4, H), st, y,
                       (const T*)x, 1, H, (const unsigned char*)L.gate.p, (const __half*)L.gate.s,
                       (const __half*)L.gate.m, (const unsigned char*)L.up.p, (const __half*)L.up.s,
                       (const __half*)L.up.m, F);
            });
        }
    time("down ln4t", dn, [&](const Layer& L) {
        launch(Ks<T>::tl4, 256, 256, 0, st, (const T*)x, 1, F, 128, y, (T*)nullptr, (T*)nullptr,
               (const unsigned char*)L.down.p, (const unsigned char*)nullptr, (const unsigned char*)nullptr,
               (const __half*)L.down.s, (const __half*)nullptr, (const __half*)nullptr, (const __half*)L.down.m,
               (const __half*)nullptr, (const __half*)nullptr, nul, nul, nul, 4096, 0, 0);
    });
    for (int S : {2, 4, 8})
        time(S == 2 ? "down bulk S=2" : S == 4 ? "down bulk S=4" : "down bulk S=8", dn, [&](const Layer& L) {
            launch(S == 2 ? plain_bulk<T, 2> : S == 4 ? plain_bulk<T, 4> : plain_bulk<T, 8>, 256, 256,
                   tmq4::bulk_smem_bytes(1, S, F), st, (const T*)x, 1, F, y, (const unsigned char*)L.down.p,
                   (const __half*)L.down.s, (const __half*)L.down.m, 4096);
        });
    // plain streaming read of the same bytes (the gate and up weights), for the roofline
    time("read-only (gate+up bytes)", 2.0 * F * H * 0.5, [&](const Layer& L) {
        launch(read_sum, 132 * 8, 256, 0, st, (const uint4*)L.gate.p, (const uint4*)L.up.p, (long long)F * H / 32, (float*)y);
    });
    CK(cudaFree(x)); CK(cudaFree(y));
}

// Mode `wq` (session 18): how gate/up's time depends on its grid (wave quantization: 896 CTAs at
// three per SM are 2.26 waves) and on where its weights are (the same layer's weights launched 32
// times, L2-resident when they fit, against 32 layers' weights from DRAM).
template <class T> static void wq(const char* dt, const std::vector<Layer>& Ls) {
    const int H = 4096, F = 14336;
    T *x, *y;
    CK(cudaMalloc(&x, F * sizeof(T))); CK(cudaMalloc(&y, F * sizeof(T)));
    fill_x<T><<<64, 256>>>(x, F, 5, 0.5f);
    cudaStream_t st; CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    const T* nul = nullptr;
    auto time = [&](auto body) { return graph_us(st, body); };
    auto gu = [&](int G, bool same) {
        return time([&](int l) {
            const Layer& L = Ls[same ? 0 : l];
            launch(Ks<T>::silu_tl, G, 256, 0, st, y, (const T*)x, 1, H, 128, (const unsigned char*)L.gate.p,
                   (const __half*)L.gate.s, (const __half*)L.gate.m, (const unsigned char*)L.up.p, (const __half*)L.up.s,
                   (const __half*)L.up.m, 16 * G, (const double*)nullptr, 0.f);
        });
    };
    for (int G : {132, 264, 396, 448, 528, 660, 792, 896}) {
        const double bytes = 2.0 * 16 * G * H * (0.5 + 4.0 / 128);
        const double d = gu(G, false), s = gu(G, true);
        printf("%s wq gate/up G=%4d (%.2f waves at 3/SM): DRAM %6.2f us %5.2f TB/s, us per 396 CTAs %6.2f | same layer %6.2f us %5.2f TB/s\n",
               dt, G, G / 396.0, d, bytes / d / 1e6, d * 396.0 / G, s, bytes / s / 1e6);
    }
    auto dn = [&](bool same) {
        return time([&](int l) {
            const Layer& L = Ls[same ? 0 : l];
            launch(Ks<T>::tl4, 256, 256, 0, st, (const T*)x, 1, F, 128, y, (T*)nullptr, (T*)nullptr,
                   (const unsigned char*)L.down.p, (const unsigned char*)nullptr, (const unsigned char*)nullptr,
                   (const __half*)L.down.s, (const __half*)nullptr, (const __half*)nullptr, (const __half*)L.down.m,
                   (const __half*)nullptr, (const __half*)nullptr, nul, nul, nul, 4096, 0, 0);
        });
    };
    const double dbytes = (double)F * H * (0.5 + 4.0 / 128);
    const double d = dn(false), s = dn(true);
    printf("%s wq down ln4t: DRAM %6.2f us %5.2f TB/s | same layer %6.2f us %5.2f TB/s\n", dt, d, dbytes / d / 1e6, s, dbytes / s / 1e6);
    CK(cudaFree(x)); CK(cudaFree(y));
}

// Mode `smi`: gate/up and down with interleaved tile-major scales against the same kernels with
// row-major ones (bitwise checked) and the shipped silu_lnt, alone and in the `at` chain.
template <class T> static void smi_iso(const char* dt, const std::vector<Layer>& Ls) {
    const int H = 4096, F = 14336;
    T *x, *y0, *y1;
    CK(cudaMalloc(&x, F * sizeof(T))); CK(cudaMalloc(&y0, F * sizeof(T))); CK(cudaMalloc(&y1, F * sizeof(T)));
    fill_x<T><<<64, 256>>>(x, F, 5, 0.5f);
    cudaStream_t st; CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    auto gu = [&](int v, const Layer& L, T* y) {
        if (v == 0)
            launch(Ks<T>::silu_tl, 896, 256, 0, st, y, (const T*)x, 1, H, 128, (const unsigned char*)L.gate.p,
                   (const __half*)L.gate.s, (const __half*)L.gate.m, (const unsigned char*)L.up.p, (const __half*)L.up.s,
                   (const __half*)L.up.m, F, (const double*)nullptr, 0.f);
        else
            launch(gu_kern<T>(v - 1), 896, 256, 0, st, y, (const T*)x, 1, H,
                   (const unsigned char*)L.gate.p, S_(L.gate, v - 1), M_(L.gate, v - 1),
                   (const unsigned char*)L.up.p, S_(L.up, v - 1), M_(L.up, v - 1), F, (const unsigned*)L.gate.smi,
                   (const unsigned*)L.up.smi);
    };
    auto dn = [&](int v, const Layer& L, T* y) {
        launch(pl_kern<T>(v - 1), 256, 256, 0, st, (const T*)x, F, y,
               (const unsigned char*)L.down.p, S_(L.down, v - 1), M_(L.down, v - 1), (const unsigned*)L.down.smi, 4096);
    };
    auto cmp = [&](const char* what, int cnt) {
        CK(cudaStreamSynchronize(st));
        std::vector<T> a(cnt), b(cnt);
        CK(cudaMemcpy(a.data(), y0, cnt * sizeof(T), cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(b.data(), y1, cnt * sizeof(T), cudaMemcpyDeviceToHost));
        int bad = 0;
        for (int i = 0; i < cnt; ++i) bad += memcmp(&a[i], &b[i], sizeof(T)) != 0;
        printf("%s check %s: %d of %d differ (sample %g)\n", dt, what, bad, cnt, (float)a[cnt / 3]);
    };
    CK(cudaMemset(y1, 0, F * sizeof(T))); gu(0, Ls[0], y0); gu(1, Ls[0], y1); cmp("gate/up silu_s (row-major scales) vs silu_lnt", F);
    CK(cudaMemset(y1, 0, F * sizeof(T))); gu(2, Ls[0], y1); cmp("gate/up silu_s smi vs silu_lnt", F);
    CK(cudaMemset(y1, 0, F * sizeof(T))); gu(3, Ls[0], y1); cmp("gate/up silu_s tile-major scales vs silu_lnt", F);
    CK(cudaMemset(y1, 0, F * sizeof(T))); dn(1, Ls[0], y0); dn(2, Ls[0], y1); cmp("down plain_smi smi vs row-major", H);
    CK(cudaMemset(y1, 0, F * sizeof(T))); dn(3, Ls[0], y1); cmp("down plain_smi tile-major scales vs row-major", H);
    auto time = [&](auto body) { return graph_us(st, [&](int l) { body(Ls[l]); }); };
    for (int r = 0; r < 2; ++r) {
        double t[4], d[3];
        for (int v = 0; v < 4; ++v) t[v] = time([&](const Layer& L) { gu(v, L, y0); });
        for (int v = 1; v < 4; ++v) d[v - 1] = time([&](const Layer& L) { dn(v, L, y0); });
        printf("%s smi iso gate/up: silu_lnt %6.2f | silu_s row-major %6.2f | smi %6.2f | tile-major %6.2f us\n", dt, t[0], t[1], t[2], t[3]);
        printf("%s smi iso down (U=2): row-major %6.2f | smi %6.2f | tile-major %6.2f us\n", dt, d[0], d[1], d[2]);
    }
    CK(cudaFree(x)); CK(cudaFree(y0)); CK(cudaFree(y1));
}

template <class T> static void run(const char* dt, const std::vector<Layer>& Ls) {
    const int H = 4096, F = 14336;
    Bufs<T> b;
    for (T** p : {&b.resid, &b.delta, &b.normed, &b.q, &b.act, &b.gamma}) CK(cudaMalloc(p, F * sizeof(T)));
    CK(cudaMalloc(&b.sink, 1024 * sizeof(float)));
    CK(cudaMalloc(&b.inv_freq, 64 * sizeof(float)));
    CK(cudaMemset(b.inv_freq, 0, 64 * sizeof(float)));
    CK(cudaMalloc(&b.pos, 4)); CK(cudaMemset(b.pos, 0, 4));
    CK(cudaMalloc(&b.slot, 4)); CK(cudaMemset(b.slot, 0, 4));
    CK(cudaMalloc(&b.kc, 64 * 1024 * sizeof(T))); CK(cudaMalloc(&b.vc, 64 * 1024 * sizeof(T)));
    CK(cudaMalloc(&b.k, 1024 * sizeof(T))); CK(cudaMalloc(&b.v, 1024 * sizeof(T)));
    cudaStream_t st; CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    auto reset = [&] {
        fill_x<T><<<64, 256>>>(b.resid, H, 11, 1.0f);
        fill_x<T><<<64, 256>>>(b.gamma, H, 13, 1.0f);
        CK(cudaMemset(b.delta, 0, H * sizeof(T)));
        CK(cudaDeviceSynchronize());
    };
    struct Case { Form form; int att; int rope; int pf_mb; int pf_off_rows; int tl; int silu; };
    const Case all[] = {{LATE, 0, 0}, {EARLY, 0, 0}, {NONE, 0, 0}, {LATE, 1, 0}, {EARLY, 2, 0}, {NONE, 2, 0},
                        {EARLY, 2, 1}, {LATE, 0, 0}, {EARLY, 0, 0}, {LATE, 1, 0}, {EARLY, 2, 0}, {EARLY, 2, 1}};
    // L2 prefetch of gate/up rows during the attention stand-in: MiB of each weight, first row.
    const Case pfc[] = {{EARLY, 2, 0, 0, 0},    {EARLY, 2, 0, 4, 0},    {EARLY, 2, 0, 8, 0}, {EARLY, 2, 0, 12, 0},
                        {EARLY, 2, 0, 16, 0},   {EARLY, 2, 0, 4, 4224}, {EARLY, 2, 0, 8, 4224}, {EARLY, 2, 0, 12, 4224},
                        {EARLY, 2, 0, 0, 0}, {EARLY, 2, 1, 0, 0}, {EARLY, 2, 1, 8, 0}};
    const Case tlc[] = {{EARLY, 2, 0, 0, 0, 0}, {EARLY, 2, 0, 0, 0, 1}, {NONE, 0, 0, 0, 0, 0}, {NONE, 0, 0, 0, 0, 1},
                        {EARLY, 2, 0, 0, 0, 0}, {EARLY, 2, 0, 0, 0, 1}, {NONE, 0, 0, 0, 0, 0}, {NONE, 0, 0, 0, 0, 1}};
    std::vector<Case> cases(g_pf_only ? std::begin(pfc) : std::begin(all), g_pf_only ? std::end(pfc) : std::end(all));
    if (g_tl_only) cases.assign(std::begin(tlc), std::end(tlc));
    const Case g4c[] = {{EARLY, 2, 0, 0, 0, 1, 0}, {EARLY, 2, 0, 0, 0, 1, 1}, {EARLY, 2, 0, 0, 0, 1, 2},
                        {NONE, 0, 0, 0, 0, 1, 0},  {NONE, 0, 0, 0, 0, 1, 1},  {NONE, 0, 0, 0, 0, 1, 2},
                        {EARLY, 2, 0, 0, 0, 1, 0}, {EARLY, 2, 0, 0, 0, 1, 1}, {EARLY, 2, 0, 0, 0, 1, 2}};
    if (g_g4_only) cases.assign(std::begin(g4c), std::end(g4c));
    const Case atc[] = {{EARLY, 2, 0, 0, 0, 1, 0}, {EARLY, 3, 0, 0, 0, 1, 0}, {EARLY, 0, 0, 0, 0, 1, 0},
                        {EARLY, 2, 0, 0, 0, 1, 0}, {EARLY, 3, 0, 0, 0, 1, 0}, {EARLY, 0, 0, 0, 0, 1, 0}};
    // pk: {on, o, MiB of gate/up}; all with attn_decode, early joins, tile-major.
    const int pkc[][3] = {{0, 0, 0}, {1, 0, 0}, {1, 1, 0}, {1, 0, 8}, {1, 1, 8}, {1, 0, 12}, {1, 1, 12}, {1, 0, 16},
                          {0, 0, 0}, {1, 0, 0}, {1, 1, 8}, {1, 0, 12}};
    if (g_pk_only) cases.assign(sizeof pkc / sizeof pkc[0], Case{EARLY, 3, 0, 0, 0, 1, 0});
    // 16: harness kernels, row-major; 17: gate/up smi; 19: gate/up smi+pf; 18: gate/up pf;
    // 16 + 2 + 8 = 26: pf everywhere; 27: gate/up smi+pf, o/down pf
    const int smc2[] = {48, 17, 18, 56, 26, 48, 17, 18, 56, 26, 48, 18};
    if (g_smi_only) cases.assign(sizeof smc2 / sizeof smc2[0], Case{EARLY, 3, 0, 0, 0, 1, 0});
    if (g_at_only || g_bk_only || g_pk_only || g_smi_only) {
        if (g_at_only) cases.assign(std::begin(atc), std::end(atc));
        AttnBufs& a = g_ab;
        const size_t per = (size_t)ASPLITS * ABLK * 8 * 128;  // elements of one layer's K (or V) cache
        a.kc.clear(); a.vc.clear();
        for (int l = 0; l < 32; ++l) {
            T *k, *v;
            CK(cudaMalloc(&k, per * sizeof(T))); CK(cudaMalloc(&v, per * sizeof(T)));
            fill_x<T><<<256, 256>>>(k, per, 1000 + l, 1.0f);
            fill_x<T><<<256, 256>>>(v, per, 2000 + l, 1.0f);
            a.kc.push_back(k); a.vc.push_back(v);
        }
        const int meta[4] = {0, 1, ACTX, 0};
        unsigned bt[ASPLITS];
        for (int i = 0; i < ASPLITS; ++i) bt[i] = (i * 7 + 3) % ASPLITS;  // a shuffled table
        CK(cudaMalloc(&a.meta, sizeof meta)); CK(cudaMemcpy(a.meta, meta, sizeof meta, cudaMemcpyHostToDevice));
        CK(cudaMalloc(&a.bt, sizeof bt)); CK(cudaMemcpy(a.bt, bt, sizeof bt, cudaMemcpyHostToDevice));
        CK(cudaMalloc(&a.cnt, 64 * 4)); CK(cudaMemset(a.cnt, 0, 64 * 4));
        CK(cudaMalloc(&a.po, 32 * ASPLITS * 128 * 4)); CK(cudaMalloc(&a.pml, 32 * ASPLITS * 2 * 4));
        CK(cudaMalloc(&a.out, 4096 * sizeof(T)));
    }
    // Mode bk: Case.silu carries g_bk; attention itself in the chain (needs the `at` buffers).
    // pf_off_rows carries the persistent grid (g_bk & 16).
    const Case bkc[] = {{EARLY, 3, 0, 0, 0, 1, 0},  {EARLY, 3, 0, 0, 0, 1, 32}, {EARLY, 3, 0, 0, 0, 1, 96},
                        {EARLY, 3, 0, 0, 0, 1, 224}, {NONE, 0, 0, 0, 0, 1, 0},   {NONE, 0, 0, 0, 0, 1, 224},
                        {EARLY, 3, 0, 0, 0, 1, 0},  {EARLY, 3, 0, 0, 0, 1, 32}, {EARLY, 3, 0, 0, 0, 1, 96},
                        {EARLY, 3, 0, 0, 0, 1, 224}};
    const Case smc[] = {{EARLY, 3, 0, 0, 0, 1, 0}, {EARLY, 3, 0, 0, 0, 1, 3}, {EARLY, 3, 0, 0, 0, 1, 4},
                        {EARLY, 3, 0, 0, 0, 1, 5}, {EARLY, 3, 0, 0, 0, 1, 6}, {EARLY, 3, 0, 0, 0, 1, 7},
                        {EARLY, 3, 0, 0, 0, 1, 8}, {EARLY, 3, 0, 0, 0, 1, 0}, {EARLY, 3, 0, 0, 0, 1, 3},
                        {EARLY, 3, 0, 0, 0, 1, 5}, {EARLY, 3, 0, 0, 0, 1, 6}};
    if (g_sm_only) cases.assign(std::begin(smc), std::end(smc));
    if (g_bk_only && !g_sm_only) {
        cases.assign(std::begin(bkc), std::end(bkc));
        check_bulk<T>(Ls[0], b);
    }
    printf("GEMVs trigger after their loops: %d\n", TM_Q4_GEMV_EARLY_TRIGGER);
    for (const Case& c : cases) {
        if (g_smi_only) g_smi = smc2[&c - &cases[0]];
        if (g_pk_only) {
            const int* k = pkc[&c - &cases[0]];
            g_pk_on = k[0];
            g_pk_o = k[1];
            g_pk_gu = (long long)k[2] << 20;
        }
        const Form form = c.form;
        g_att = c.att;
        g_rope = c.rope;
        g_pf = (long long)c.pf_mb << 20;
        g_tl = c.tl;
        g_silu = g_bk_only && !g_sm_only ? 0 : c.silu;
        g_bk = g_bk_only && !g_sm_only ? c.silu : 0;
        g_pf_off = g_bk_only ? 0 : (long long)c.pf_off_rows * 2048;
        if (g_bk_only && c.pf_off_rows) g_pers = c.pf_off_rows;
        reset();
        cudaGraph_t g; cudaGraphExec_t ge;
        CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
        step<T>(Ls, b, form, st);
        CK(cudaStreamEndCapture(st, &g));
        CK(cudaGraphInstantiate(&ge, g, 0));
        for (int i = 0; i < 5; ++i) CK(cudaGraphLaunch(ge, st));
        cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
        const int iters = 50;
        CK(cudaEventRecord(e0, st));
        for (int i = 0; i < iters; ++i) CK(cudaGraphLaunch(ge, st));
        CK(cudaEventRecord(e1, st)); CK(cudaEventSynchronize(e1));
        float ms; CK(cudaEventElapsedTime(&ms, e0, e1));
        const char* att[] = {"", " + attention stand-in", " + attention stand-in (early trigger)",
                             " + attn_decode (600 keys, 10 splits)"};
        printf("%s %-9s: %7.1f us per step%s%s", dt, form_names[form], 1000.f * ms / iters, g_rope ? " + rope_write_kv" : "",
               att[g_att]);
        if (g_tl) printf(" [tile-major]");
        if (g_silu >= 3) printf(" [gate/up variant %d]", g_silu - 3);
        else if (g_silu) printf(" [gate/up U = %d, x at use, 2 CTAs/SM]", g_silu + 2);
        if (g_bk & 16) printf(" [gate/up persistent, grid %d]", g_pers);
        if (g_bk & 224) printf(" [cp.async ring U=4:%s%s%s]", g_bk & 32 ? " gate/up" : "", g_bk & 64 ? " down" : "", g_bk & 128 ? " o" : "");
        if (g_bk_only) printf(" [bulk-staged:%s%s%s%s]", g_bk & 1 ? " gate/up" : "", g_bk & 2 ? " down (S = 8)" : "",
                              g_bk & 8 ? " down (S = 4)" : "", g_bk & 4 ? " o" : "");
        if (g_pf) printf(", L2 prefetch of %lld MiB of gate and of up from row %d", g_pf >> 20, c.pf_off_rows);
        if (g_smi) printf(" [%s%s, o/down plain U=2%s%s]", g_smi & 32 ? "silu_lnt" : "harness gate/up", g_smi & 1 ? " smi" : g_smi & 2 ? " tile-major scales" : "",
                          g_smi & 4 ? " smi" : g_smi & 8 ? " tile-major scales" : "",
                          g_smi & 64 ? (g_smi & 128 ? ", q/k/v qkv2 smi" : ", q/k/v qkv2") : "");
        if (g_pk_on) printf(" [L2 prefetch kernel before attention:%s %lld MiB of gate and of up]", g_pk_o ? " o," : "", g_pk_gu >> 20);
        printf("\n");
        CK(cudaGraphExecDestroy(ge)); CK(cudaGraphDestroy(g));
    }
}

int main(int argc, char** argv) {
    g_v_only = argc > 1 && std::string(argv[1]) == "v";
    g_pf_only = argc > 1 && std::string(argv[1]) == "pf";
    g_tl_only = argc > 1 && std::string(argv[1]) == "tl";
    g_g4_only = argc > 1 && std::string(argv[1]) == "g4";
    g_at_only = argc > 1 && std::string(argv[1]) == "at";
    g_bk_only = argc > 1 && (std::string(argv[1]) == "bk" || std::string(argv[1]) == "sm");
    g_sm_only = argc > 1 && std::string(argv[1]) == "sm";
    g_pk_only = argc > 1 && std::string(argv[1]) == "pk";
    g_smi_only = argc > 1 && std::string(argv[1]) == "smi";
    setvbuf(stdout, nullptr, _IONBF, 0);
    std::vector<Layer> Ls;
    for (int l = 0; l < 32; ++l) {
        unsigned s = 100 * l;
        Ls.push_back(Layer{make_w(4096, 4096, s + 1), make_w(1024, 4096, s + 2), make_w(1024, 4096, s + 3),
                           make_w(4096, 4096, s + 4), make_w(14336, 4096, s + 5), make_w(14336, 4096, s + 6),
                           make_w(4096, 14336, s + 7)});
    }
    CK(cudaDeviceSynchronize());
    if (g_smi_only) {
        for (Layer& L : Ls)
            for (W* w : {&L.q, &L.k, &L.v, &L.o, &L.gate, &L.up, &L.down}) add_smi(*w);
        CK(cudaDeviceSynchronize());
        smi_iso<__half>("f16", Ls);
        smi_iso<__nv_bfloat16>("bf16", Ls);
    }
    if (argc > 1 && std::string(argv[1]) == "wq") {
        wq<__half>("f16", Ls);
        wq<__nv_bfloat16>("bf16", Ls);
        return 0;
    }
    if (argc > 1 && (std::string(argv[1]) == "iso" || g_v_only)) {
        iso<__half>("f16", Ls);
        iso<__nv_bfloat16>("bf16", Ls);
        return 0;
    }
    run<__half>("f16", Ls);
    run<__nv_bfloat16>("bf16", Ls);
    return 0;
}

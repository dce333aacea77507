// The K-quant tiles of kquants.c, written once and included twice: with 8-lane (256-bit) vectors and, in
// AVX512-VNNI builds, with 16-lane (512-bit) ones (the macros KV_* below, defined by kquants.c before each
// include). One text for both widths keeps their arithmetic the same per lane: the same exact integer sums,
// the same fp32 factors, the same FMAs in the same order, so every build gives the same bits.
// No include guard on purpose.
//
// A tile: KV_LANES output columns (at `h * KV_LANES` within the interleaved group of GW) x MR_ rows, over all the
// superblocks of the group's stream `w` (kquants.c describes the layout). Two tiles per kind, one per activation
// scheme (kquants.c): scales per 32 (kmin_tile, k6_tile) or per superblock of 256 (kmin_tile_sb, k6_tile_sb).

// One 32-weight sub-block's codes of the tile's KV_LANES columns, as the unsigned operand of the dot products:
// lo[jj] elements 4jj..4jj+3, hi[jj] elements 16+4jj.. of each column (kquants.c, the layout). Q4_K / Q5_K (HB):
static inline __attribute__((always_inline)) void KV_NAME(kmin_codes)(const uint8_t *wb, int h, const int HB,
                                                                      KV_I lo[4], KV_I hi[4]) {
    const KV_I m4 = KV_SET1_8(0x0F), b4 = KV_SET1_8(0x10);
    const KV_I hw = HB ? KV_LOAD(wb + GW * 16 + KV_LANES * 4 * h) : KV_ZERO_I();
#pragma GCC unroll 4
    for (int jj = 0; jj < 4; jj++) {
        const KV_I raw = KV_LOAD(wb + GW * 4 * jj + KV_LANES * 4 * h);
        lo[jj] = KV_AND(raw, m4);
        hi[jj] = KV_AND(KV_SRLI16(raw, 4), m4);
        if (HB) {  // the 5th bit of element 4jj+t sits at bit 8t+jj of the column's word, of 16+4jj+t at 8t+4+jj
            lo[jj] = KV_OR(lo[jj], KV_AND(KV_SLLI32(hw, 4 - jj), b4));
            hi[jj] = KV_OR(hi[jj], KV_AND(KV_SRLI32(hw, jj), b4));
        }
    }
}

// Q6_K's (0..63)
static inline __attribute__((always_inline)) void KV_NAME(k6_codes)(const uint8_t *wb, int h, KV_I lo[4],
                                                                    KV_I hi[4]) {
    const KV_I m4 = KV_SET1_8(0x0F), b45 = KV_SET1_8(0x30);
    // bits 4-5 of the codes: byte t of vector pair p (words ha: vectors 0-1, hb: 2-3) holds, from bit 0,
    // elements 4(2p)+t, 16+4(2p)+t, 4(2p+1)+t, 16+4(2p+1)+t: one shift (within bytes once masked) each
    const KV_I ha = KV_LOAD(wb + GW * 16 + KV_LANES * 4 * h), hb = KV_LOAD(wb + GW * 20 + KV_LANES * 4 * h);
#pragma GCC unroll 4
    for (int jj = 0; jj < 4; jj++) {
        const KV_I raw = KV_LOAD(wb + GW * 4 * jj + KV_LANES * 4 * h), hv = jj < 2 ? ha : hb;
        lo[jj] = KV_OR(KV_AND(raw, m4), KV_AND(jj & 1 ? hv : KV_SLLI16(hv, 4), b45));
        hi[jj] = KV_OR(KV_AND(KV_SRLI16(raw, 4), m4), KV_AND(jj & 1 ? KV_SRLI16(hv, 2) : KV_SLLI16(hv, 2), b45));
    }
}

#if KV_VNNI
// The two halves' exact dot products with a row's 32 codes q (VNNI): s0 elements 0..15, s1 16..31
static inline __attribute__((always_inline)) void KV_NAME(half_dots)(const KV_I lo[4], const KV_I hi[4],
                                                                     const int8_t *q, KV_I *s0, KV_I *s1) {
    KV_I a = KV_DPB(KV_ZERO_I(), lo[0], q), b = KV_DPB(KV_ZERO_I(), hi[0], q + 16);
#pragma GCC unroll 3
    for (int jj = 1; jj < 4; jj++) {
        a = KV_DPB(a, lo[jj], q + 4 * jj);
        b = KV_DPB(b, hi[jj], q + 16 + 4 * jj);
    }
    *s0 = a, *s1 = b;
}
#else
// AVX2 (no VNNI): u8 x s8 pairs into 16-bit sums (maddubs) against a row's 32 codes q, added while they still fit
// 16 bits (the tiles' bounds). Q4_K / Q5_K: each half's 4 partials summed, p0 elements 0..15, p1 16..31 (|.| <= 4 *
// 2 * 31 * 127 < 32768)
static inline __attribute__((always_inline)) void KV_NAME(kmin_partials)(const KV_I lo[4], const KV_I hi[4],
                                                                         const int8_t *q, KV_I *p0, KV_I *p1) {
    KV_I a = KV_MADDUBS(lo[0], KV_BCAST4(q)), b = KV_MADDUBS(hi[0], KV_BCAST4(q + 16));
#pragma GCC unroll 3
    for (int jj = 1; jj < 4; jj++) {
        a = KV_ADD16(a, KV_MADDUBS(lo[jj], KV_BCAST4(q + 4 * jj)));
        b = KV_ADD16(b, KV_MADDUBS(hi[jj], KV_BCAST4(q + 16 + 4 * jj)));
    }
    *p0 = a, *p1 = b;
}

// Q6_K (codes 0..63): two maddubs at a time (<= 4 * 63 * 127 < 32768): p[0], p[1] elements 0..15, p[2], p[3] 16..31
static inline __attribute__((always_inline)) void KV_NAME(k6_partials)(const KV_I lo[4], const KV_I hi[4],
                                                                       const int8_t *q, KV_I p[4]) {
    p[0] = KV_ADD16(KV_MADDUBS(lo[0], KV_BCAST4(q)), KV_MADDUBS(lo[1], KV_BCAST4(q + 4)));
    p[1] = KV_ADD16(KV_MADDUBS(lo[2], KV_BCAST4(q + 8)), KV_MADDUBS(lo[3], KV_BCAST4(q + 12)));
    p[2] = KV_ADD16(KV_MADDUBS(hi[0], KV_BCAST4(q + 16)), KV_MADDUBS(hi[1], KV_BCAST4(q + 20)));
    p[3] = KV_ADD16(KV_MADDUBS(hi[2], KV_BCAST4(q + 24)), KV_MADDUBS(hi[3], KV_BCAST4(q + 28)));
}
#endif

// Q4_K (HB = 0) and Q5_K (HB = 1): per sub-block j of 32 weights, w = (d * sc_j) * q - (dmin * m_j); both factors
// are exact in fp32 (an fp16 times a 6-bit integer). Per row and sub-block:
//   acc = fma((d * sc_j) * dx, sum(q * qx), acc);  acc = fnmadd(dmin * m_j, sx, acc)   (sx = dx * sum(qx))
static inline __attribute__((always_inline)) void KV_NAME(kmin_tile)(const int8_t *qx, const float *dx,
                                                                     const float *sx, int nsb, int r0,
                                                                     const uint8_t *w, int h, float *y, int N,
                                                                     int n0, const int MR_, const int HB) {
    const int SUB = HB ? 20 * GW : 16 * GW, SB = 8 * SUB + 20 * GW, nb = 8 * nsb;
    const int pf = mc_pf_hint[PF_FAM_KQ][MR_ > 1];
    KV_F acc[TR];
#pragma GCC unroll 4
    for (int r = 0; r < MR_; r++) acc[r] = KV_ZERO_PS();
#if !KV_VNNI
    const KV_I ones = KV_SET1_16(1);
#endif
    for (int s = 0; s < nsb; s++) {
        const uint8_t *sb = w + (size_t)s * SB, *scales = sb + 8 * SUB;
        prefetch_lines(scales + PF_AHEAD, 20 * GW, pf);
        const KV_F dv = KV_LOAD_F16((const uint16_t *)(scales + 16 * GW) + KV_LANES * h);
        const KV_F mv = KV_LOAD_F16((const uint16_t *)(scales + 18 * GW) + KV_LANES * h);
        for (int j = 0; j < 8; j++) {
            const uint8_t *wb = sb + j * SUB;
            prefetch_lines(wb + PF_AHEAD, SUB, pf);
            KV_I lo[4], hi[4];
            KV_NAME(kmin_codes)(wb, h, HB, lo, hi);
            const KV_F a = KV_MUL_PS(dv, KV_U8_PS(scales + GW * j + KV_LANES * h));
            const KV_F b = KV_MUL_PS(mv, KV_U8_PS(scales + 8 * GW + GW * j + KV_LANES * h));
#pragma GCC unroll 4
            for (int r = 0; r < MR_; r++) {
                const size_t xb = (size_t)(r0 + r) * nb + (size_t)s * 8 + j;
                const int8_t *q = qx + xb * QK;
#if KV_VNNI
                KV_I s0, s1;
                KV_NAME(half_dots)(lo, hi, q, &s0, &s1);
                const KV_F dot = KV_CVT_PS(KV_ADD32(s0, s1));
#else
                KV_I p0, p1;
                KV_NAME(kmin_partials)(lo, hi, q, &p0, &p1);
                // Q4_K: both halves' partials add up in 16 bits too (16 products <= 16 * 15 * 127 = 30480), one
                // widening instead of two: the same integer
                const KV_F dot = KV_CVT_PS(HB ? KV_ADD32(KV_MADD16(p0, ones), KV_MADD16(p1, ones))
                                              : KV_MADD16(KV_ADD16(p0, p1), ones));
#endif
                acc[r] = KV_FMADD(KV_MUL_PS(a, KV_SET1_PS(dx[xb])), dot, acc[r]);
                acc[r] = KV_FNMADD(b, KV_SET1_PS(sx[xb]), acc[r]);
            }
        }
    }
    const int wdt = N - n0 < KV_LANES ? N - n0 : KV_LANES;
#pragma GCC unroll 4
    for (int r = 0; r < MR_; r++) KV_STORE(y + (size_t)(r0 + r) * N + n0, acc[r], wdt);
}

// Q6_K: per half-block k of 16 weights, w = (d * sc_k) * (q - 32), q in 0..63, sc_k an int8 (exact in fp32).
// Per row and 32-block (its halves 0 = elements 0..15 = vectors lo, 1 = 16..31 = vectors hi):
//   acc = fma((d * sc_2j) * dx, sum(q * qx) - 32 * sum(qx), acc) for half 0, then the same for half 1
// (sum(qx) per half: the activation scratch's per-16 sums, kquants.c).
static inline __attribute__((always_inline)) void KV_NAME(k6_tile)(const int8_t *qx, const float *dx,
                                                                   const int16_t *s16, int nsb, int r0,
                                                                   const uint8_t *w, int h, float *y, int N,
                                                                   int n0, const int MR_) {
    const int SUB = 24 * GW, SB = 8 * SUB + 18 * GW, nb = 8 * nsb;
    const int pf = mc_pf_hint[PF_FAM_KQ][MR_ > 1];
    KV_F acc[TR];
#pragma GCC unroll 4
    for (int r = 0; r < MR_; r++) acc[r] = KV_ZERO_PS();
#if !KV_VNNI
    const KV_I ones = KV_SET1_16(1);
#endif
    for (int s = 0; s < nsb; s++) {
        const uint8_t *sb = w + (size_t)s * SB, *scales = sb + 8 * SUB;
        prefetch_lines(scales + PF_AHEAD, 18 * GW, pf);
        const KV_F dv = KV_LOAD_F16((const uint16_t *)(scales + 16 * GW) + KV_LANES * h);
        for (int j = 0; j < 8; j++) {
            const uint8_t *wb = sb + j * SUB;
            prefetch_lines(wb + PF_AHEAD, SUB, pf);
            KV_I lo[4], hi[4];
            KV_NAME(k6_codes)(wb, h, lo, hi);
            const KV_F a0 = KV_MUL_PS(dv, KV_I8_PS(scales + GW * (2 * j) + KV_LANES * h));
            const KV_F a1 = KV_MUL_PS(dv, KV_I8_PS(scales + GW * (2 * j + 1) + KV_LANES * h));
#pragma GCC unroll 4
            for (int r = 0; r < MR_; r++) {
                const size_t xb = (size_t)(r0 + r) * nb + (size_t)s * 8 + j;
                const int8_t *q = qx + xb * QK;
#if KV_VNNI
                KV_I s0, s1;
                KV_NAME(half_dots)(lo, hi, q, &s0, &s1);
#else
                // pairs up to 2 * 63 * 127: two of them still fit 16 bits, then 32-bit sums
                KV_I p[4];
                KV_NAME(k6_partials)(lo, hi, q, p);
                KV_I s0 = KV_ADD32(KV_MADD16(p[0], ones), KV_MADD16(p[1], ones));
                KV_I s1 = KV_ADD32(KV_MADD16(p[2], ones), KV_MADD16(p[3], ones));
#endif
                s0 = KV_SUB32(s0, KV_SET1_32(32 * (int)s16[2 * xb]));
                s1 = KV_SUB32(s1, KV_SET1_32(32 * (int)s16[2 * xb + 1]));
                const KV_F x = KV_SET1_PS(dx[xb]);
                acc[r] = KV_FMADD(KV_MUL_PS(a0, x), KV_CVT_PS(s0), acc[r]);
                acc[r] = KV_FMADD(KV_MUL_PS(a1, x), KV_CVT_PS(s1), acc[r]);
            }
        }
    }
    const int wdt = N - n0 < KV_LANES ? N - n0 : KV_LANES;
#pragma GCC unroll 4
    for (int r = 0; r < MR_; r++) KV_STORE(y + (size_t)(r0 + r) * N + n0, acc[r], wdt);
}

// Activations per superblock (kquants.c, the superblock schemes: nested, or llama.cpp's Q8_K where every m_j is
// 16): a row's sub-block j stands for dk * m_j * q, so a superblock's sum is one integer per row and column, the
// sub-blocks' dot products times their weight scale and their activation multiplier (sc_j * m_j, a 16-bit
// product: <= 63 * 16 = 1008, Q6_K |.| <= 128 * 16 = 2048), and the fp32 factors apply once per superblock and
// row (kquants.c: the formulas, with dk). Scratch: qx [M, K]; dk one scale per row and superblock; mm the
// multipliers as (m, m) 16-bit pairs [M, K / 32]; s16 the codes' sums per 16 times m [M, K / 16].
// Integer bounds (codes |qx| <= 127): every operation is exact modulo 2^32 (32-bit adds, subtracts, mullo, shifts;
// madd16 never sees two -32768 pairs), so only the true values need to fit an int32:
//   Q4_K / Q5_K: a sub-block's dot <= 32 * 15 * 127 = 60960 / 32 * 31 * 127 = 125984, times sc * m <= 1008, 8
//   sub-blocks: <= 1.02e9; the minimum term 8 * 63 * 16 * 32 * 127 = 32.8e6.
//   Q6_K: per half of 16, sum((q - 32) * qx) <= 16 * 32 * 127 = 65024, times |sc * m| <= 2048, 16 halves:
//   <= 2130706432 < 2^31 (the tile sums sc * m * sum(q * qx) and the -32 term apart; their difference is that).
// AVX2 (no VNNI) multiplies u8 x s8 pairs into 16-bit sums (maddubs), then widens them with madd16 against the
// (sc * m, sc * m) 16-bit pair: the scale multiply rides on the widening. Its 16-bit partials: Q4_K all 8
// maddubs of a sub-block, 16 products <= 16 * 15 * 127 = 30480; Q5_K 4 per half (<= 31496); Q6_K 2 at a time
// (<= 4 * 63 * 127 = 32004), each < 32768. VNNI builds take the 32-bit dot products (dpbusd) times sc * m
// (mullo; sc * m from a madd16 of (sc, 0) against (m, m)): the same integers. (tests/test_kquants.py holds every
// code and scale at its bound.)
//
// Q4_K (HB = 0) and Q5_K (HB = 1)
static inline __attribute__((always_inline)) void KV_NAME(kmin_tile_sb)(const int8_t *qx, const float *dk,
                                                                     const int16_t *s16, const int32_t *mm,
                                                                     int nsb, int r0, const uint8_t *w, int h,
                                                                     float *y, int N, int n0, const int MR_,
                                                                     const int HB) {
    const int SUB = HB ? 20 * GW : 16 * GW, SB = 8 * SUB + 20 * GW, K = 256 * nsb;
    const int pf = mc_pf_hint[PF_FAM_KQ][MR_ > 1];
    KV_F acc[TR];
#pragma GCC unroll 4
    for (int r = 0; r < MR_; r++) acc[r] = KV_ZERO_PS();
    for (int s = 0; s < nsb; s++) {
        const uint8_t *sb = w + (size_t)s * SB, *scales = sb + 8 * SUB;
        prefetch_lines(scales + PF_AHEAD, 20 * GW, pf);
        KV_I isum[TR];
#pragma GCC unroll 4
        for (int r = 0; r < MR_; r++) isum[r] = KV_ZERO_I();
        for (int j = 0; j < 8; j++) {
            const uint8_t *wb = sb + j * SUB;
            prefetch_lines(wb + PF_AHEAD, SUB, pf);
            KV_I lo[4], hi[4];
            KV_NAME(kmin_codes)(wb, h, HB, lo, hi);
            const KV_I sc = KV_U8_32(scales + GW * j + KV_LANES * h);  // 0..63 per column
#if !KV_VNNI
            const KV_I sc2 = KV_OR(sc, KV_SLLI32(sc, 16));  // (sc, sc) as 16-bit pairs
#endif
#pragma GCC unroll 4
            for (int r = 0; r < MR_; r++) {
                const size_t blk = ((size_t)(r0 + r) * nsb + s) * 8 + j;
                const int8_t *q = qx + (size_t)(r0 + r) * K + (size_t)s * 256 + 32 * j;
                const KV_I m2 = KV_SET1_32(mm[blk]);  // (m, m)
#if KV_VNNI
                KV_I s0, s1;
                KV_NAME(half_dots)(lo, hi, q, &s0, &s1);
                isum[r] = KV_ADD32(isum[r], KV_MULLO32(KV_ADD32(s0, s1), KV_MADD16(sc, m2)));
#else
                const KV_I scm = KV_MULLO16(sc2, m2);  // (sc * m, sc * m)
                KV_I p0, p1;
                KV_NAME(kmin_partials)(lo, hi, q, &p0, &p1);
                if (HB)
                    isum[r] = KV_ADD32(isum[r], KV_ADD32(KV_MADD16(p0, scm), KV_MADD16(p1, scm)));
                else
                    isum[r] = KV_ADD32(isum[r], KV_MADD16(KV_ADD16(p0, p1), scm));
#endif
            }
        }
        // sum_j mn_j * m_j * sum(qx_j): each minimum as a (mn_j, mn_j) 16-bit pair against the row's two per-16
        // code sums of sub-block j (already times m_j)
        const uint8_t *mins = scales + 8 * GW;
        KV_I mp[8];
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            const KV_I mn = KV_U8_32(mins + GW * j + KV_LANES * h);
            mp[j] = KV_OR(mn, KV_SLLI32(mn, 16));
        }
        const KV_F dv = KV_LOAD_F16((const uint16_t *)(scales + 16 * GW) + KV_LANES * h);
        const KV_F mv = KV_LOAD_F16((const uint16_t *)(scales + 18 * GW) + KV_LANES * h);
#pragma GCC unroll 4
        for (int r = 0; r < MR_; r++) {
            const int8_t *hs = (const int8_t *)(s16 + ((size_t)(r0 + r) * nsb + s) * 16);
            KV_I ms = KV_MADD16(mp[0], KV_BCAST4(hs));
#pragma GCC unroll 7
            for (int j = 1; j < 8; j++) ms = KV_ADD32(ms, KV_MADD16(mp[j], KV_BCAST4(hs + 4 * j)));
            const KV_F x = KV_SET1_PS(dk[(size_t)(r0 + r) * nsb + s]);
            acc[r] = KV_FMADD(KV_MUL_PS(dv, x), KV_CVT_PS(isum[r]), acc[r]);
            acc[r] = KV_FNMADD(KV_MUL_PS(mv, x), KV_CVT_PS(ms), acc[r]);
        }
    }
    const int wdt = N - n0 < KV_LANES ? N - n0 : KV_LANES;
#pragma GCC unroll 4
    for (int r = 0; r < MR_; r++) KV_STORE(y + (size_t)(r0 + r) * N + n0, acc[r], wdt);
}

// Q6_K: per half-block k of 16 weights, w = (d * sc_k) * (q - 32), q in 0..63, sc_k an int8. Per row and
// superblock: sum_k sc_k * m_k * sum(q * qx) - 32 * sum_k sc_k * (m_k * sum(qx)) (32-blocks j: halves k = 2j
// (elements 0..15, vectors lo) and 2j + 1 (16..31, vectors hi), both with the sub-block's m_j).
static inline __attribute__((always_inline)) void KV_NAME(k6_tile_sb)(const int8_t *qx, const float *dk,
                                                                   const int16_t *s16, const int32_t *mm,
                                                                   int nsb, int r0, const uint8_t *w, int h,
                                                                   float *y, int N, int n0, const int MR_) {
    const int SUB = 24 * GW, SB = 8 * SUB + 18 * GW, K = 256 * nsb;
    const int pf = mc_pf_hint[PF_FAM_KQ][MR_ > 1];
    KV_F acc[TR];
#pragma GCC unroll 4
    for (int r = 0; r < MR_; r++) acc[r] = KV_ZERO_PS();
    const KV_I low16 = KV_SET1_32(0xFFFF);
    for (int s = 0; s < nsb; s++) {
        const uint8_t *sb = w + (size_t)s * SB, *scales = sb + 8 * SUB;
        prefetch_lines(scales + PF_AHEAD, 18 * GW, pf);
        KV_I isum[TR];
#pragma GCC unroll 4
        for (int r = 0; r < MR_; r++) isum[r] = KV_ZERO_I();
        for (int j = 0; j < 8; j++) {
            const uint8_t *wb = sb + j * SUB;
            prefetch_lines(wb + PF_AHEAD, SUB, pf);
            KV_I lo[4], hi[4];
            KV_NAME(k6_codes)(wb, h, lo, hi);
            // the halves' scales as (sc, 0) (VNNI) or (sc, sc) (AVX2) 16-bit pairs
            const KV_I sa = KV_AND(KV_I8_32(scales + GW * (2 * j) + KV_LANES * h), low16);
            const KV_I sb2 = KV_AND(KV_I8_32(scales + GW * (2 * j + 1) + KV_LANES * h), low16);
#if !KV_VNNI
            const KV_I sa2 = KV_OR(sa, KV_SLLI32(sa, 16)), sb22 = KV_OR(sb2, KV_SLLI32(sb2, 16));
#endif
#pragma GCC unroll 4
            for (int r = 0; r < MR_; r++) {
                const size_t blk = ((size_t)(r0 + r) * nsb + s) * 8 + j;
                const int8_t *q = qx + (size_t)(r0 + r) * K + (size_t)s * 256 + 32 * j;
                const KV_I m2 = KV_SET1_32(mm[blk]);  // (m, m)
#if KV_VNNI
                KV_I s0, s1;
                KV_NAME(half_dots)(lo, hi, q, &s0, &s1);
                isum[r] = KV_ADD32(isum[r], KV_ADD32(KV_MULLO32(s0, KV_MADD16(sa, m2)),
                                                     KV_MULLO32(s1, KV_MADD16(sb2, m2))));
#else
                const KV_I sam = KV_MULLO16(sa2, m2), sbm = KV_MULLO16(sb22, m2);  // (sc * m, sc * m)
                KV_I p[4];
                KV_NAME(k6_partials)(lo, hi, q, p);
                isum[r] = KV_ADD32(isum[r], KV_ADD32(KV_ADD32(KV_MADD16(p[0], sam), KV_MADD16(p[1], sam)),
                                                     KV_ADD32(KV_MADD16(p[2], sbm), KV_MADD16(p[3], sbm))));
#endif
            }
        }
        // sum_k sc_k * (m_k * sum(qx_k)): per 32-block the scales of its halves as a 16-bit pair against the row's
        // two per-16 code sums (already times m_j)
        KV_I off[TR];
#pragma GCC unroll 4
        for (int r = 0; r < MR_; r++) off[r] = KV_ZERO_I();
        for (int j = 0; j < 8; j++) {
            const KV_I sp = KV_OR(KV_AND(KV_I8_32(scales + GW * (2 * j) + KV_LANES * h), low16),
                                  KV_SLLI32(KV_I8_32(scales + GW * (2 * j + 1) + KV_LANES * h), 16));
#pragma GCC unroll 4
            for (int r = 0; r < MR_; r++) {
                const int8_t *pair = (const int8_t *)(s16 + (((size_t)(r0 + r) * nsb + s) * 8 + j) * 2);
                off[r] = KV_ADD32(off[r], KV_MADD16(sp, KV_BCAST4(pair)));
            }
        }
        const KV_F dv = KV_LOAD_F16((const uint16_t *)(scales + 16 * GW) + KV_LANES * h);
#pragma GCC unroll 4
        for (int r = 0; r < MR_; r++) {
            const KV_F x = KV_SET1_PS(dk[(size_t)(r0 + r) * nsb + s]);
            acc[r] = KV_FMADD(KV_MUL_PS(dv, x), KV_CVT_PS(KV_SUB32(isum[r], KV_SLLI32(off[r], 5))), acc[r]);
        }
    }
    const int wdt = N - n0 < KV_LANES ? N - n0 : KV_LANES;
#pragma GCC unroll 4
    for (int r = 0; r < MR_; r++) KV_STORE(y + (size_t)(r0 + r) * N + n0, acc[r], wdt);
}

// The K-quant tiles of kquants.c, written once and included twice: with 8-lane (256-bit) vectors and, in
// AVX512-VNNI builds, with 16-lane (512-bit) ones (the macros KV_* below, defined by kquants.c before each
// include). One text for both widths keeps their arithmetic the same per lane: the same exact integer sums,
// the same fp32 factors, the same FMAs in the same order, so every build gives the same bits.
// No include guard on purpose.
//
// A tile: KV_LANES output columns (at `h * KV_LANES` within the interleaved group of GW) x MR_ rows, over all the
// superblocks of the group's stream `w` (kquants.c describes the layout).

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
    const KV_I m4 = KV_SET1_8(0x0F), b4 = KV_SET1_8(0x10);
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
            const KV_F a = KV_MUL_PS(dv, KV_U8_PS(scales + GW * j + KV_LANES * h));
            const KV_F b = KV_MUL_PS(mv, KV_U8_PS(scales + 8 * GW + GW * j + KV_LANES * h));
#pragma GCC unroll 4
            for (int r = 0; r < MR_; r++) {
                const size_t xb = (size_t)(r0 + r) * nb + (size_t)s * 8 + j;
                const int8_t *q = qx + xb * QK;
#if KV_VNNI
                KV_I s0 = KV_DPB(KV_ZERO_I(), lo[0], q);
                KV_I s1 = KV_DPB(KV_ZERO_I(), hi[0], q + 16);
#pragma GCC unroll 3
                for (int jj = 1; jj < 4; jj++) {
                    s0 = KV_DPB(s0, lo[jj], q + 4 * jj);
                    s1 = KV_DPB(s1, hi[jj], q + 16 + 4 * jj);
                }
                const KV_F dot = KV_CVT_PS(KV_ADD32(s0, s1));
#else
                // 16-bit partial sums: 4 pairs of a half add up exactly (|sum| <= 4 * 2 * 31 * 127 < 32768)
                KV_I p0 = KV_MADDUBS(lo[0], KV_BCAST4(q)), p1 = KV_MADDUBS(hi[0], KV_BCAST4(q + 16));
#pragma GCC unroll 3
                for (int jj = 1; jj < 4; jj++) {
                    p0 = KV_ADD16(p0, KV_MADDUBS(lo[jj], KV_BCAST4(q + 4 * jj)));
                    p1 = KV_ADD16(p1, KV_MADDUBS(hi[jj], KV_BCAST4(q + 16 + 4 * jj)));
                }
                const KV_F dot = KV_CVT_PS(KV_ADD32(KV_MADD16(p0, ones), KV_MADD16(p1, ones)));
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
    const KV_I m4 = KV_SET1_8(0x0F), b45 = KV_SET1_8(0x30);
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
            // bits 4-5 of the codes: byte t of vector pair p (words ha: vectors 0-1, hb: 2-3) holds, from bit 0,
            // elements 4(2p)+t, 16+4(2p)+t, 4(2p+1)+t, 16+4(2p+1)+t: one shift (within bytes once masked) each
            const KV_I ha = KV_LOAD(wb + GW * 16 + KV_LANES * 4 * h), hb = KV_LOAD(wb + GW * 20 + KV_LANES * 4 * h);
#pragma GCC unroll 4
            for (int jj = 0; jj < 4; jj++) {
                const KV_I raw = KV_LOAD(wb + GW * 4 * jj + KV_LANES * 4 * h), hv = jj < 2 ? ha : hb;
                lo[jj] = KV_OR(KV_AND(raw, m4), KV_AND(jj & 1 ? hv : KV_SLLI16(hv, 4), b45));
                hi[jj] = KV_OR(KV_AND(KV_SRLI16(raw, 4), m4), KV_AND(jj & 1 ? KV_SRLI16(hv, 2) : KV_SLLI16(hv, 2), b45));
            }
            const KV_F a0 = KV_MUL_PS(dv, KV_I8_PS(scales + GW * (2 * j) + KV_LANES * h));
            const KV_F a1 = KV_MUL_PS(dv, KV_I8_PS(scales + GW * (2 * j + 1) + KV_LANES * h));
#pragma GCC unroll 4
            for (int r = 0; r < MR_; r++) {
                const size_t xb = (size_t)(r0 + r) * nb + (size_t)s * 8 + j;
                const int8_t *q = qx + xb * QK;
#if KV_VNNI
                KV_I s0 = KV_DPB(KV_ZERO_I(), lo[0], q);
                KV_I s1 = KV_DPB(KV_ZERO_I(), hi[0], q + 16);
#pragma GCC unroll 3
                for (int jj = 1; jj < 4; jj++) {
                    s0 = KV_DPB(s0, lo[jj], q + 4 * jj);
                    s1 = KV_DPB(s1, hi[jj], q + 16 + 4 * jj);
                }
#else
                // pairs up to 2 * 63 * 127: two of them still fit 16 bits, then 32-bit sums
                const KV_I p0 = KV_ADD16(KV_MADDUBS(lo[0], KV_BCAST4(q)), KV_MADDUBS(lo[1], KV_BCAST4(q + 4)));
                const KV_I p1 = KV_ADD16(KV_MADDUBS(lo[2], KV_BCAST4(q + 8)), KV_MADDUBS(lo[3], KV_BCAST4(q + 12)));
                const KV_I p2 = KV_ADD16(KV_MADDUBS(hi[0], KV_BCAST4(q + 16)), KV_MADDUBS(hi[1], KV_BCAST4(q + 20)));
                const KV_I p3 = KV_ADD16(KV_MADDUBS(hi[2], KV_BCAST4(q + 24)), KV_MADDUBS(hi[3], KV_BCAST4(q + 28)));
                KV_I s0 = KV_ADD32(KV_MADD16(p0, ones), KV_MADD16(p1, ones));
                KV_I s1 = KV_ADD32(KV_MADD16(p2, ones), KV_MADD16(p3, ones));
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

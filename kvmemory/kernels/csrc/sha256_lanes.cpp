// SHA-256 of up to 16 equal-length messages at once, and a reader that fills cache rows from block
// files and hashes them in the same pass.
//
// Why: verifying a graft is SHA-256 over every byte grafted. SHA-NI (what OpenSSL, hence hashlib,
// uses) hashes one message at ~1.7 GB/s per core on the AVX-512 EPYC of BENCHMARKS.md; a chain's blocks
// are independent messages of one size, so there 16 of them share each instruction, in the 16 32-bit
// lanes of AVX-512 registers: ~2.7 GB/s per core. Built with -DKVM_SHA_NI (CPUs with SHA-NI but no
// AVX-512), each lane is hashed on its own with the SHA-NI instructions instead, right after its
// rows are read, while they are still in the core's cache: the reader is the same, only the hash differs.
// The digests are plain SHA-256 (FIPS 180-4), checked against hashlib by the tests.
//
// The reader does not read a block straight into its rows of the cache: it reads a slab of rows into
// its own scratch buffer (kept per thread, so it stays in the core's caches), hashes them there, and
// stores the same bytes into the cache rows with non-temporal stores. Read straight into place, every
// cache line the kernel's copy writes was first fetched from memory (a read for ownership) and then
// hashed from a buffer too large for the caches: staged, an 8k-token graft's read and verify (188 MB)
// ran 9 % faster side by side (median of 12 rounds, Zen 4, AVX-512 build; the SHA-NI build 3 %).
//
// Plain C entry points (no Python, no torch headers), called through ctypes, which releases the GIL.
// Every lane's message is a list of `nseg` segments of `seg_bytes` bytes each (a multiple of 64), the
// same for all lanes: for a block, its rows in the cache ([layer, K|V, head] -> C positions x D).

#include <immintrin.h>
#include <climits>
#include <fcntl.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

constexpr int kLanes = 16;
constexpr uint32_t kK[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};
constexpr uint32_t kH0[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                             0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};

// Segment k of every lane; idle lanes (l >= lanes) hash lane 0's bytes again (their digests are not returned).
inline void lane_pointers(const uint64_t* seg, int lanes, int64_t nseg, int64_t k, const uint8_t* p[kLanes]) {
    for (int l = 0; l < kLanes; ++l) p[l] = reinterpret_cast<const uint8_t*>(seg[(l < lanes ? l : 0) * nseg + k]);
}

#ifndef KVM_SHA_NI  // AVX-512: 16 lanes in one register

inline __m512i ror(__m512i x, int n) { return _mm512_ror_epi32(x, n); }
inline __m512i add(__m512i a, __m512i b) { return _mm512_add_epi32(a, b); }

// Row i of r holds lane i's 16 message words; afterwards row j holds word j of every lane.
inline void transpose16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {
        u[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int g = 0; g < 2; ++g)
        for (int i = 0; i < 4; ++i) {
            t[8 * g + i] = _mm512_shuffle_i32x4(u[8 * g + i], u[8 * g + i + 4], 0x88);
            t[8 * g + i + 4] = _mm512_shuffle_i32x4(u[8 * g + i], u[8 * g + i + 4], 0xdd);
        }
    for (int i = 0; i < 8; ++i) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    }
}

// One 64-byte block of every lane (words already big-endian-decoded, one register per word).
inline void compress(__m512i s[8], __m512i W[16]) {
    __m512i a = s[0], b = s[1], c = s[2], d = s[3], e = s[4], f = s[5], g = s[6], h = s[7];
#pragma GCC unroll 64
    for (int t = 0; t < 64; ++t) {
        __m512i w;
        if (t < 16) {
            w = W[t];
        } else {
            __m512i w15 = W[(t - 15) & 15], w2 = W[(t - 2) & 15];
            __m512i s0 = _mm512_ternarylogic_epi32(ror(w15, 7), ror(w15, 18), _mm512_srli_epi32(w15, 3), 0x96);
            __m512i s1 = _mm512_ternarylogic_epi32(ror(w2, 17), ror(w2, 19), _mm512_srli_epi32(w2, 10), 0x96);
            w = add(add(W[t & 15], s0), add(s1, W[(t - 7) & 15]));
            W[t & 15] = w;
        }
        // The sums are grouped so that what does not depend on this round's e and a (h + K + w, and
        // d + that) is added off the critical path: e and a each wait for four operations, not five.
        const __m512i hkw = add(h, add(w, _mm512_set1_epi32(static_cast<int>(kK[t]))));
        const __m512i dhkw = add(d, hkw);
        __m512i S1 = _mm512_ternarylogic_epi32(ror(e, 6), ror(e, 11), ror(e, 25), 0x96);
        __m512i ch = _mm512_ternarylogic_epi32(e, f, g, 0xCA);  // (e & f) ^ (~e & g)
        __m512i S0 = _mm512_ternarylogic_epi32(ror(a, 2), ror(a, 13), ror(a, 22), 0x96);
        __m512i maj = _mm512_ternarylogic_epi32(a, b, c, 0xE8);
        const __m512i s1ch = add(S1, ch);
        h = g; g = f; f = e; e = add(dhkw, s1ch);
        d = c; c = b; b = a; a = add(add(hkw, s1ch), add(S0, maj));
    }
    s[0] = add(s[0], a); s[1] = add(s[1], b); s[2] = add(s[2], c); s[3] = add(s[3], d);
    s[4] = add(s[4], e); s[5] = add(s[5], f); s[6] = add(s[6], g); s[7] = add(s[7], h);
}

struct Lanes {
    __m512i s[8];
    explicit Lanes(int) { for (int i = 0; i < 8; ++i) s[i] = _mm512_set1_epi32(static_cast<int>(kH0[i])); }

    // `bytes` (a multiple of 64) from each of the 16 pointers.
    void update(const uint8_t* const p[kLanes], int64_t bytes) {
        const __m512i bswap = _mm512_set4_epi32(0x0c0d0e0f, 0x08090a0b, 0x04050607, 0x00010203);
        for (int64_t off = 0; off < bytes; off += 64) {
            __m512i W[16];
            for (int l = 0; l < kLanes; ++l) W[l] = _mm512_shuffle_epi8(_mm512_loadu_si512(p[l] + off), bswap);
            transpose16(W);
            compress(s, W);
        }
    }

    // As update, and each lane's bytes are also stored at d[l] (none where d[l] is null), from the
    // register that is hashed: the bytes stored are the bytes hashed. Non-temporal stores when
    // `Stream` (every d[l] 64-byte aligned).
    template <bool Stream>
    void update_store(const uint8_t* const p[kLanes], uint8_t* const d[kLanes], int64_t bytes) {
        const __m512i bswap = _mm512_set4_epi32(0x0c0d0e0f, 0x08090a0b, 0x04050607, 0x00010203);
        for (int64_t off = 0; off < bytes; off += 64) {
            __m512i W[16];
            for (int l = 0; l < kLanes; ++l) {
                const __m512i x = _mm512_loadu_si512(p[l] + off);
                if (d[l]) {
                    if (Stream) _mm512_stream_si512(reinterpret_cast<__m512i*>(d[l] + off), x);
                    else _mm512_storeu_si512(d[l] + off, x);
                }
                W[l] = _mm512_shuffle_epi8(x, bswap);
            }
            transpose16(W);
            compress(s, W);
        }
    }

    // The reader's hooks: lane l's slab (its segments k0..k0+n-1, read into scratch `src`, n segments
    // back to back) has just been read (nothing to do: the lanes are hashed together once every
    // lane's are), then every lane's has: hash them and store them to their segments where `put[l]`
    // (lane l's slab was read whole and there are segments; else it is hashed, never stored).
    void lane_read(int, const uint8_t*, const uint64_t*, int64_t, int64_t, int64_t, int64_t, bool, bool) {}
    void slab_read(const uint8_t* scratch, int64_t lane_bytes, const bool* put, const uint64_t* seg, int lanes,
                   int64_t nseg, int64_t k0, int64_t n, int64_t seg_bytes, bool stream) {
        const uint8_t* p[kLanes];
        uint8_t* d[kLanes];
        for (int64_t k = 0; k < n; ++k) {
            for (int l = 0; l < kLanes; ++l) {  // idle lanes hash lane 0's bytes again, and store nothing
                p[l] = scratch + (l < lanes ? l : 0) * lane_bytes + k * seg_bytes;
                d[l] = l < lanes && put[l] ? reinterpret_cast<uint8_t*>(seg[l * nseg + k0 + k]) : nullptr;
            }
            if (stream) update_store<true>(p, d, seg_bytes);
            else update_store<false>(p, d, seg_bytes);
        }
    }

    // The padding block of a message of `total` bytes (a multiple of 64: the padding is a block of its own).
    void finish(int64_t total, uint8_t* digests, int lanes) {
        __m512i W[16];
        const uint64_t bits = static_cast<uint64_t>(total) * 8;
        for (int j = 0; j < 16; ++j) W[j] = _mm512_setzero_si512();
        W[0] = _mm512_set1_epi32(static_cast<int>(0x80000000u));
        W[14] = _mm512_set1_epi32(static_cast<int>(bits >> 32));
        W[15] = _mm512_set1_epi32(static_cast<int>(bits & 0xffffffffu));
        compress(s, W);
        alignas(64) uint32_t out[8][kLanes];
        for (int i = 0; i < 8; ++i) _mm512_store_si512(out[i], s[i]);
        for (int l = 0; l < lanes; ++l)
            for (int i = 0; i < 8; ++i) {
                const uint32_t v = out[i][l];
                uint8_t* d = digests + 32 * l + 4 * i;
                d[0] = v >> 24; d[1] = v >> 16; d[2] = v >> 8; d[3] = v;
            }
    }
};

#else  // KVM_SHA_NI: one lane at a time with the SHA-NI instructions

// The state as SHA-NI keeps it: ABEF and CDGH (from the reference layout of Intel's SHA extensions).
struct ShaNiState {
    __m128i abef, cdgh;
};

inline ShaNiState sha_ni_init() {
    __m128i t = _mm_shuffle_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kH0)), 0xB1);  // CDAB
    __m128i efgh = _mm_shuffle_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kH0 + 4)), 0x1B);
    return {_mm_alignr_epi8(t, efgh, 8), _mm_blend_epi16(efgh, t, 0xF0)};
}

// `blocks` 64-byte blocks from `p` (big-endian words are decoded here).
inline void sha_ni_blocks(ShaNiState& st, const uint8_t* p, int64_t blocks) {
    const __m128i bswap = _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
    __m128i s0 = st.abef, s1 = st.cdgh;
    for (int64_t b = 0; b < blocks; ++b, p += 64) {
        const __m128i save0 = s0, save1 = s1;
        __m128i m[4];
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) {  // rounds 4j .. 4j+3
            __m128i w;
            if (j < 4) {
                w = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * j)), bswap);
            } else {  // W[t] = s1(W[t-2]) + W[t-7] + s0(W[t-15]) + W[t-16], four at a time
                __m128i x = _mm_sha256msg1_epu32(m[j & 3], m[(j + 1) & 3]);
                x = _mm_add_epi32(x, _mm_alignr_epi8(m[(j + 3) & 3], m[(j + 2) & 3], 4));
                w = _mm_sha256msg2_epu32(x, m[(j + 3) & 3]);
            }
            m[j & 3] = w;
            const __m128i wk = _mm_add_epi32(w, _mm_loadu_si128(reinterpret_cast<const __m128i*>(kK + 4 * j)));
            s1 = _mm_sha256rnds2_epu32(s1, s0, wk);
            s0 = _mm_sha256rnds2_epu32(s0, s1, _mm_shuffle_epi32(wk, 0x0E));
        }
        s0 = _mm_add_epi32(s0, save0);
        s1 = _mm_add_epi32(s1, save1);
    }
    st.abef = s0;
    st.cdgh = s1;
}

struct Lanes {
    ShaNiState s[kLanes];
    int lanes;
    explicit Lanes(int n) : lanes(n) { for (int l = 0; l < kLanes; ++l) s[l] = sha_ni_init(); }

    void update_lane(int l, const uint8_t* p, int64_t bytes) { sha_ni_blocks(s[l], p, bytes / 64); }

    void update(const uint8_t* const p[kLanes], int64_t bytes) {
        for (int l = 0; l < lanes; ++l) update_lane(l, p[l], bytes);
    }

    // The reader's hooks: lane l's slab (its segments k0..k0+n-1, read into scratch `src`, n segments
    // back to back) has just been read: hash it while it is still in this core's cache, then store
    // the bytes hashed to its segments (when `put`: read whole, and there are segments), non-temporal
    // when `stream`; then every lane's has (nothing left to do).
    void lane_read(int l, const uint8_t* src, const uint64_t* seg, int64_t nseg, int64_t k0, int64_t n,
                   int64_t seg_bytes, bool put, bool stream) {
        update_lane(l, src, n * seg_bytes);
        if (!put) return;
        for (int64_t k = 0; k < n; ++k) {
            const uint8_t* from = src + k * seg_bytes;
            uint8_t* to = reinterpret_cast<uint8_t*>(seg[l * nseg + k0 + k]);
            if (!stream) { std::memcpy(to, from, static_cast<size_t>(seg_bytes)); continue; }
            for (int64_t off = 0; off < seg_bytes; off += 16)
                _mm_stream_si128(reinterpret_cast<__m128i*>(to + off),
                                 _mm_load_si128(reinterpret_cast<const __m128i*>(from + off)));
        }
    }
    void slab_read(const uint8_t*, int64_t, const bool*, const uint64_t*, int, int64_t, int64_t, int64_t, int64_t,
                   bool) {}

    void finish(int64_t total, uint8_t* digests, int n) {
        alignas(16) uint8_t pad[64] = {0x80};
        const uint64_t bits = static_cast<uint64_t>(total) * 8;
        for (int i = 0; i < 8; ++i) pad[63 - i] = static_cast<uint8_t>(bits >> (8 * i));
        for (int l = 0; l < n; ++l) {
            sha_ni_blocks(s[l], pad, 1);
            // ABEF, CDGH back to A..H
            const __m128i feba = _mm_shuffle_epi32(s[l].abef, 0x1B);
            const __m128i dchg = _mm_shuffle_epi32(s[l].cdgh, 0xB1);
            alignas(16) uint32_t h[8];
            _mm_store_si128(reinterpret_cast<__m128i*>(h), _mm_blend_epi16(feba, dchg, 0xF0));      // DCBA -> a b c d
            _mm_store_si128(reinterpret_cast<__m128i*>(h + 4), _mm_alignr_epi8(dchg, feba, 8));   // HGFE -> e f g h
            for (int i = 0; i < 8; ++i) {
                uint8_t* d = digests + 32 * l + 4 * i;
                d[0] = h[i] >> 24; d[1] = h[i] >> 16; d[2] = h[i] >> 8; d[3] = h[i];
            }
        }
    }
};

#endif  // KVM_SHA_NI


// Read `n` bytes at `off` into the `count` buffers of `iov` (updated on a short read); bytes read.
int64_t preadv_all(int fd, struct iovec* iov, int count, int64_t off) {
    int64_t total = 0;
    while (count > 0) {
        const ssize_t got = preadv(fd, iov, std::min(count, IOV_MAX), off + total);
        if (got < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        if (got == 0) break;
        total += got;
        size_t left = static_cast<size_t>(got);
        while (count > 0 && left >= iov->iov_len) { left -= iov->iov_len; ++iov; --count; }
        if (count > 0 && left) {
            iov->iov_base = static_cast<uint8_t*>(iov->iov_base) + left;
            iov->iov_len -= left;
        }
    }
    return total;
}

// The reader thread's scratch buffer: kept for the thread's life (reader threads live as long as the
// process), so it stays mapped and, between calls, in the core's caches.
struct Scratch {
    uint8_t* p = nullptr;
    int64_t bytes = 0;
    ~Scratch() { std::free(p); }
    uint8_t* get(int64_t need) {
        if (need > bytes) {
            std::free(p);
            p = static_cast<uint8_t*>(std::aligned_alloc(64, static_cast<size_t>(need)));
            bytes = p ? need : 0;
        }
        return p;
    }
};
thread_local Scratch scratch_of_thread;

// At most this many scratch bytes per call: every lane's slab (16 lanes x 16 rows of 8 KB for
// SmolLM2's blocks); a larger block's slab is cut to fewer rows.
constexpr int64_t kScratchBytes = 4 << 20;

}  // namespace

// The library is built with -fvisibility=hidden: only these entry points are exported.
#pragma GCC visibility push(default)
extern "C" {

// The version of the calling convention below; sha256_lanes.py refuses a library of another.
int kvm_sha256_abi_version() { return 1; }

// Digests (lanes x 32 bytes) of `lanes` (1..16) messages of `nseg` segments of `seg_bytes` bytes:
// segment k of lane l starts at seg[l * nseg + k]. Returns 0, or -1 on bad arguments.
int kvm_sha256_lanes(int lanes, int64_t nseg, int64_t seg_bytes, const uint64_t* seg, uint8_t* digests) {
    if (lanes < 1 || lanes > kLanes || nseg < 0 || seg_bytes < 0 || seg_bytes % 64) return -1;
    Lanes h(lanes);
    const uint8_t* p[kLanes];
    for (int64_t k = 0; k < nseg; ++k) {
        lane_pointers(seg, lanes, nseg, k, p);
        h.update(p, seg_bytes);
    }
    h.finish(nseg * seg_bytes, digests, lanes);
    return 0;
}

// Read each lane's payload from its file, hash it and store it into its segments: lane l opens
// `paths[l]`, checks that the file begins with the `offsets[l]` bytes at `heads[l]` (the header the
// caller has checked before; no check where `heads[l]` is null), then its payload from byte
// `offsets[l]` on is read `slab` segments at a time (fewer where the slab would pass kScratchBytes)
// into this thread's scratch (one pread per lane), hashed there while still in the cache, and the
// bytes hashed are stored into the lane's segments (non-temporal stores where every segment is
// 64-byte aligned), then the next slab. A slab read short is hashed but not stored. With `seg` null
// nothing is stored (the bench's raw read-and-hash: the payload read into scratch and hashed). Opening and
// comparing here, not in the caller, keeps a reader thread's per-block work free of the GIL.
// `got[l]` = payload bytes read, plus one when the file holds more bytes after the payload (a probe
// of one byte), so the caller sees truncation and trailing bytes; or kMissing (no such file),
// kHeadChanged (the file does not begin with heads[l]), -1 (any other error opening or reading). A
// lane that fails or ends early stops being read; its digest is then meaningless and got[l] says so.
// Returns 0, or -1 on bad arguments.
constexpr int64_t kMissing = -2, kHeadChanged = -3;

int kvm_read_hash_lanes(int lanes, const char* const* paths, const int64_t* offsets, const uint8_t* const* heads,
                        int64_t nseg, int64_t seg_bytes, const uint64_t* seg, int64_t slab, int64_t* got,
                        uint8_t* digests) {
    if (lanes < 1 || lanes > kLanes || nseg < 0 || seg_bytes < 0 || seg_bytes % 64 || slab < 1) return -1;
    for (int l = 0; l < lanes; ++l)
        if (offsets[l] < 0 || (heads[l] && offsets[l] > 1 << 20)) return -1;
    Lanes h(lanes);
    int fd[kLanes];
    bool ok[kLanes];
    std::vector<uint8_t> head;
    for (int l = 0; l < lanes; ++l) {
        got[l] = 0;
        fd[l] = open(paths[l], O_RDONLY | O_CLOEXEC);
        ok[l] = fd[l] >= 0;
        if (!ok[l]) { got[l] = errno == ENOENT ? kMissing : -1; continue; }
        if (!heads[l]) continue;
        head.resize(static_cast<size_t>(offsets[l]));
        const ssize_t r = pread(fd[l], head.data(), head.size(), 0);
        if (r != offsets[l] || std::memcmp(head.data(), heads[l], head.size()) != 0) {
            got[l] = r < 0 ? -1 : kHeadChanged;
            ok[l] = false;
        }
    }
    slab = std::max<int64_t>(1, std::min<int64_t>(slab, kScratchBytes / (static_cast<int64_t>(lanes) * std::max<int64_t>(seg_bytes, 64))));
    const int64_t lane_bytes = slab * seg_bytes;
    uint8_t* scratch = scratch_of_thread.get(std::max<int64_t>(lanes * lane_bytes, 64));
    if (!scratch) {
        for (int l = 0; l < lanes; ++l) {
            if (fd[l] >= 0) close(fd[l]);
            if (ok[l]) got[l] = -1;
        }
        return 0;
    }
    bool stream = seg != nullptr;  // non-temporal stores need 64-byte aligned segments (torch's CPU buffers are)
    for (int64_t i = 0; i < lanes * nseg && stream; ++i) stream = seg[i] % 64 == 0;
    for (int64_t k0 = 0; k0 < nseg; k0 += slab) {
        const int64_t n = std::min(slab, nseg - k0);
        bool put[kLanes] = {};  // lanes whose slab is stored: read whole, and segments given
        for (int l = 0; l < lanes; ++l) {
            if (!ok[l]) continue;
            uint8_t* src = scratch + l * lane_bytes;
            struct iovec iov = {src, static_cast<size_t>(n * seg_bytes)};
            const int64_t r = preadv_all(fd[l], &iov, 1, offsets[l] + k0 * seg_bytes);
            if (r < 0) { got[l] = -1; ok[l] = false; continue; }
            got[l] += r;
            if (r < n * seg_bytes) ok[l] = false;  // truncated: nothing more to read
            put[l] = ok[l] && seg != nullptr;
            h.lane_read(l, src, seg, nseg, k0, n, seg_bytes, put[l], stream);
        }
        h.slab_read(scratch, lane_bytes, put, seg, lanes, nseg, k0, n, seg_bytes, stream);
    }
    if (stream) _mm_sfence();  // the stores are seen by other threads before the caller hears of them
    for (int l = 0; l < lanes; ++l) {
        if (ok[l]) {
            uint8_t probe;
            const ssize_t r = pread(fd[l], &probe, 1, offsets[l] + nseg * seg_bytes);
            if (r < 0) got[l] = -1;
            else got[l] += r;
        }
        if (fd[l] >= 0) close(fd[l]);
    }
    h.finish(nseg * seg_bytes, digests, lanes);
    return 0;
}

}  // extern "C"
#pragma GCC visibility pop

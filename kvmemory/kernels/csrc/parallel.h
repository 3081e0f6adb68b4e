// parallel_for over [begin, end) on OpenMP threads, split exactly as torch's at::parallel_for splits
// it (ATen/ParallelOpenMP.h): ceil(n / threads) consecutive items per thread, serial when the range
// is within one grain, when one thread is asked for, or inside a parallel region already. The
// kernels' bytes never depend on the split (each item is computed by one thread, alone); keeping
// torch's split keeps their speed, and linking -fopenmp shares torch's own libgomp and its threads
// (torch is imported before a kernel library is loaded, so libgomp.so.1 is already there).
//
// The kernels are C entry points, so nothing may throw through them: an exception in a thread (a
// failed allocation) is caught and reported by the return value.
#pragma once

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace kvm {

// f(begin, end) on up to `threads` threads; false when a call of f threw.
template <typename F>
bool parallel_for(int threads, int64_t begin, int64_t end, int64_t grain, const F& f) {
    if (begin >= end) return true;
    const int64_t n = end - begin;
    if (n <= grain || n <= 1 || threads <= 1 || omp_in_parallel()) {
        try {
            f(begin, end);
        } catch (...) {
            return false;
        }
        return true;
    }
    std::atomic<bool> failed{false};
    // The team is always `threads` strong (torch's own team size: libgomp keeps its pool as it is);
    // the items go to the first ceil(n / grain) of them, as in torch.
#pragma omp parallel num_threads(threads)
    {
        int64_t team = omp_get_num_threads();
        if (grain > 0) team = std::min(team, (n + grain - 1) / grain);
        const int64_t chunk = (n + team - 1) / team;
        const int64_t b = begin + omp_get_thread_num() * chunk;
        if (b < end) {
            try {
                f(b, std::min(end, b + chunk));
            } catch (...) {
                failed = true;
            }
        }
    }
    return !failed;
}

}  // namespace kvm

// Scratch memory of the kernels: one growable arena per thread, taken and given back in scopes (a stack),
// so the per-call and per-step buffers (the layer loop's activations, qgemm's packed rows and panels,
// attention's per-thread tiles) are mapped once and reused instead of allocated and freed every call.
//
// Why: glibc raises its dynamic mmap threshold to the size of the largest mmap'd block freed (up to 32 MiB),
// and these buffers (up to ~17 MiB at 512 rows) were freed every step; after that every smaller temporary
// of the process came from glibc's heaps, which fragmented under mixed step sizes (the soak's RSS less the
// KV pool crept up; benchmarks/results/soak.md). An arena maps its memory directly (mmap, never malloc), so
// glibc never sees it, and keeps it: it grows to the most its thread's open scopes held at once and does not
// shrink while serving. `kv_scratch_release` unmaps the arenas of threads that have not used theirs for a
// while (server/heap.py calls it from its periodic trim, so an idle server gives the memory back).
// Alone this does not keep that RSS flat (torch's freed tensors raise the threshold too); what it changes
// is the price of pinning glibc's threshold (KVSERVE_MMAP_THRESHOLD): the kernels no longer fault in
// fresh pages every call (a 500-row prefill: 159k page faults pinned before, 1.7k with the arena).
//
// Use: `ScratchScope scope; float* x = scope.take<float>(n);` -- valid until the scope ends; 64-byte
// aligned; contents undefined. Scopes nest (a kernel called inside another's scope takes after it) and are
// per thread: inside an OpenMP region each thread opens its own scope for its own buffers; a buffer shared
// by the team is taken by the calling thread before the region. A request beyond the arena's capacity gets
// its own mapping for the scope's lifetime, and the arena is remapped at the peak size once its thread's
// outermost scope ends (at most ~log2 of the growth times: capacity at least doubles; pages never touched
// are never resident).
//
// Included once, at file scope (kernels.cpp), before the per-ISA namespaces.

#include <sys/mman.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <new>
#include <type_traits>
#include <vector>

struct ScratchArena;

struct ScratchRegistry {  // every live arena, for kv_scratch_release / kv_scratch_mapped
    std::mutex lock;
    std::vector<ScratchArena*> arenas;
};

static ScratchRegistry& scratch_registry() {
    static ScratchRegistry* registry = new ScratchRegistry;  // never destroyed: threads may exit after main
    return *registry;
}

static inline int64_t scratch_now_ms() {
    return std::chrono::duration_cast<std::chrono::milliseconds>(
               std::chrono::steady_clock::now().time_since_epoch()).count();
}

constexpr size_t SCRATCH_ALIGN = 64;

struct ScratchArena {
    std::mutex busy;              // held by its thread while it has a scope open (release skips it then)
    uint8_t* base = nullptr;      // the mapping scopes take from
    std::atomic<size_t> capacity{0};  // bytes mapped at base
    size_t used = 0;              // bytes of base held by open scopes
    size_t overflow = 0;          // bytes of open scopes' own mappings (requests beyond capacity)
    size_t peak = 0;              // most bytes the open scopes held at once since the last remap
    int depth = 0;                // open scopes
    int64_t last_use_ms = 0;      // when the last outermost scope ended

    ScratchArena() {
        ScratchRegistry& r = scratch_registry();
        std::lock_guard<std::mutex> guard(r.lock);
        r.arenas.push_back(this);
    }
    ~ScratchArena() {
        ScratchRegistry& r = scratch_registry();
        std::lock_guard<std::mutex> guard(r.lock);
        for (size_t i = 0; i < r.arenas.size(); ++i)
            if (r.arenas[i] == this) {
                r.arenas[i] = r.arenas.back();
                r.arenas.pop_back();
                break;
            }
        unmap();
    }
    ScratchArena(const ScratchArena&) = delete;
    ScratchArena& operator=(const ScratchArena&) = delete;

    void unmap() {
        if (base) munmap(base, capacity.load(std::memory_order_relaxed));
        base = nullptr;
        capacity.store(0, std::memory_order_relaxed);
    }

    // Remap at least `bytes` (no scope open): at least double the old capacity, in whole 64 KiB.
    void grow(size_t bytes) {
        const size_t old = capacity.load(std::memory_order_relaxed);
        size_t size = bytes > 2 * old ? bytes : 2 * old;
        size = (size + (size_t(1) << 16) - 1) & ~((size_t(1) << 16) - 1);
        unmap();
        void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) return;  // stays empty: the next scope takes overflow mappings again
        base = static_cast<uint8_t*>(p);
        capacity.store(size, std::memory_order_relaxed);
    }
};

static ScratchArena& scratch_arena() {  // the calling thread's
    thread_local ScratchArena arena;
    return arena;
}

class ScratchScope {
  public:
    ScratchScope() : a_(scratch_arena()) {
        if (a_.depth++ == 0) a_.busy.lock();
        mark_ = a_.used;
    }
    ~ScratchScope() {
        for (const Mapping& m : own_) {
            munmap(m.p, m.bytes);
            a_.overflow -= m.bytes;
        }
        a_.used = mark_;
        if (--a_.depth == 0) {
            if (a_.peak > a_.capacity.load(std::memory_order_relaxed)) a_.grow(a_.peak);
            a_.peak = 0;
            a_.last_use_ms = scratch_now_ms();
            a_.busy.unlock();
        }
    }
    ScratchScope(const ScratchScope&) = delete;
    ScratchScope& operator=(const ScratchScope&) = delete;

    // n objects of a trivial type T (default-initialized: contents undefined), 64-byte aligned.
    template <class T>
    T* take(int64_t n) {
        static_assert(std::is_trivially_destructible<T>::value, "scratch holds trivially destructible types only");
        static_assert(alignof(T) <= SCRATCH_ALIGN, "scratch alignment is 64 bytes");
        const size_t bytes = ((n > 0 ? static_cast<size_t>(n) : 1) * sizeof(T) + SCRATCH_ALIGN - 1) & ~(SCRATCH_ALIGN - 1);
        uint8_t* p;
        if (a_.used + bytes <= a_.capacity.load(std::memory_order_relaxed)) {
            p = a_.base + a_.used;
            a_.used += bytes;
        } else {
            void* m = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            if (m == MAP_FAILED) throw std::bad_alloc();
            p = static_cast<uint8_t*>(m);
            own_.push_back(Mapping{p, bytes});
            a_.overflow += bytes;
        }
        if (a_.used + a_.overflow > a_.peak) a_.peak = a_.used + a_.overflow;
        T* out = reinterpret_cast<T*>(p);
        for (int64_t i = 0; i < n; ++i) new (out + i) T;
        return out;
    }

  private:
    struct Mapping {
        uint8_t* p;
        size_t bytes;
    };
    ScratchArena& a_;
    size_t mark_ = 0;
    std::vector<Mapping> own_;  // empty (no allocation) unless a request overflowed the arena
};

// Unmaps the arenas idle for at least min_idle_ms (no scope open, none ended since); returns the bytes unmapped.
static int64_t scratch_release(int64_t min_idle_ms) {
    ScratchRegistry& r = scratch_registry();
    std::lock_guard<std::mutex> guard(r.lock);
    const int64_t now = scratch_now_ms();
    int64_t freed = 0;
    for (ScratchArena* a : r.arenas) {
        if (!a->busy.try_lock()) continue;
        if (a->base && now - a->last_use_ms >= min_idle_ms) {
            freed += static_cast<int64_t>(a->capacity.load(std::memory_order_relaxed));
            a->unmap();
        }
        a->busy.unlock();
    }
    return freed;
}

// Bytes the arenas have mapped now (their capacities; open scopes' overflow mappings not counted).
static int64_t scratch_mapped() {
    ScratchRegistry& r = scratch_registry();
    std::lock_guard<std::mutex> guard(r.lock);
    int64_t total = 0;
    for (ScratchArena* a : r.arenas) total += static_cast<int64_t>(a->capacity.load(std::memory_order_relaxed));
    return total;
}

/* The caching-allocator replay of estimator/replay/allocator.py (``replay_sized``), in C: the same rules, the same
 * results, about 50 times faster. The Python model is the reference; this file follows it function for
 * function (_Allocator.malloc, _split, free, _cuda_malloc, _release_oversize, _release_segments and the event loop
 * of replay_sized), for what most replays are: no expandable segments, no recording. tests/test_native_replay.py
 * holds the two equal on random and real traces.
 *
 * A plain C library loaded with ctypes (estimator/replay/native.py): no Python headers, no Python objects.
 */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define KMIN_BLOCK_SIZE 512LL
#define KSMALL_SIZE 1048576LL
#define KSMALL_BUFFER 2097152LL
#define KLARGE_BUFFER 20971520LL
#define KMIN_LARGE_ALLOC 10485760LL
#define KROUND_LARGE 2097152LL
#define NO_SPLIT_LIMIT (1LL << 62)

/* bumped with any change to bf_replay's arguments or results: native.py loads only a library of its own ABI (an
 * editable install keeps the library it built until it is built again) */
#define BF_ABI 2

int bf_abi(void) { return BF_ABI; }

/* what an allocation is to the replay (native.py's KIND_*) */
enum { KIND_NORMAL = 0, KIND_SOFT = 1, KIND_EMPTY_CACHE = 2, KIND_MANAGED = 3 };

/* out[] slots */
enum {
    OUT_ALLOC_PEAK, OUT_RESERVED_PEAK, OUT_OOM_EVENT, OUT_PEAK_EVENT, OUT_SEGMENTS, OUT_FLUSHES, OUT_FAILED,
    OUT_MANAGED_PEAK, OUT_DEVICE_PEAK, OUT_EVENTS_DONE, OUT_ERROR_EVENT, OUT_ERROR_KEY, OUT_ERROR_VALUE, OUT_SLOTS
};

/* return codes */
/* return codes: 1-3 are the trace's errors (native.py raises Python's ReplayError); the rest hand the replay back to
 * Python: a key out of range, host memory, a size past what int64 arithmetic here can hold, a state Python's model
 * would not reach (a block not where the pool says) */
enum {
    OK = 0, ERR_TWICE = 1, ERR_NEGATIVE = 2, ERR_NOT_ALLOCATED = 3, ERR_KEY_RANGE = 4, ERR_MEMORY = 5,
    ERR_SIZE_RANGE = 6, ERR_STATE = 7
};

/* sizes, capacities and sums stay far from INT64_MAX below this (2^60 B: an exbibyte) */
#define SAFE_BYTES (1LL << 60)

typedef struct {
    int64_t addr, size;
    int32_t pool, prev, next;
    uint8_t small, allocated;
} Block;

typedef struct {
    int64_t size, addr;
    int32_t block;
} Entry;

typedef struct {
    Entry *e;
    int32_t n, cap;
} Pool;

typedef struct {
    Block *blocks;
    int32_t n_blocks, cap_blocks, free_list; /* recycled block slots, chained through .next */
    Pool *pools;
    int32_t n_pools;
    int64_t capacity; /* -1: none */
    int64_t max_split;
    int has_max_split;
    int64_t reserved, managed, allocated, next_addr, segments, flushes, failed;
    int oom_memory; /* a host allocation failed */
    int bad_state;  /* a block was not found in its pool */
} Allocator;

/* what stops a replay after an allocator call: host memory ran out, or a block was not where its pool says */
static int broken(const Allocator *a) { return a->oom_memory ? ERR_MEMORY : a->bad_state ? ERR_STATE : OK; }

static int32_t new_block(Allocator *a, int64_t addr, int64_t size, int small, int32_t pool) {
    int32_t i;
    if (a->free_list >= 0) {
        i = a->free_list;
        a->free_list = a->blocks[i].next;
    } else {
        if (a->n_blocks == a->cap_blocks) {
            int32_t cap = a->cap_blocks ? 2 * a->cap_blocks : 256;
            Block *grown = realloc(a->blocks, (size_t)cap * sizeof(Block));
            if (!grown) {
                a->oom_memory = 1;
                return -1;
            }
            a->blocks = grown;
            a->cap_blocks = cap;
        }
        i = a->n_blocks++;
    }
    Block *b = &a->blocks[i];
    b->addr = addr;
    b->size = size;
    b->pool = pool;
    b->prev = b->next = -1;
    b->small = (uint8_t)small;
    b->allocated = 0;
    return i;
}

static void drop_block(Allocator *a, int32_t i) {
    a->blocks[i].next = a->free_list;
    a->free_list = i;
}

/* the first entry not below (size, addr) */
static int32_t lower_bound(const Pool *p, int64_t size, int64_t addr) {
    int32_t lo = 0, hi = p->n;
    while (lo < hi) {
        int32_t mid = (lo + hi) >> 1;
        const Entry *e = &p->e[mid];
        if (e->size < size || (e->size == size && e->addr < addr))
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static void pool_remove_at(Pool *p, int32_t i) {
    memmove(&p->e[i], &p->e[i + 1], (size_t)(p->n - i - 1) * sizeof(Entry));
    p->n--;
}

static void insert(Allocator *a, int32_t bi) { /* _insert */
    Block *b = &a->blocks[bi];
    Pool *p = &a->pools[b->pool];
    if (p->n == p->cap) {
        int32_t cap = p->cap ? 2 * p->cap : 64;
        Entry *grown = realloc(p->e, (size_t)cap * sizeof(Entry));
        if (!grown) {
            a->oom_memory = 1;
            return;
        }
        p->e = grown;
        p->cap = cap;
    }
    int32_t i = lower_bound(p, b->size, b->addr);
    memmove(&p->e[i + 1], &p->e[i], (size_t)(p->n - i) * sizeof(Entry));
    p->e[i].size = b->size;
    p->e[i].addr = b->addr;
    p->e[i].block = bi;
    p->n++;
}

static void remove_block(Allocator *a, int32_t bi) { /* _remove */
    Block *b = &a->blocks[bi];
    Pool *p = &a->pools[b->pool];
    int32_t i = lower_bound(p, b->size, b->addr);
    if (i >= p->n || p->e[i].block != bi) { /* not in its pool: Python's model answers (it raises) */
        a->bad_state = 1;
        return;
    }
    pool_remove_at(p, i);
}

static int64_t allocation_size(int64_t size) {
    if (size <= KSMALL_SIZE)
        return KSMALL_BUFFER;
    if (size < KMIN_LARGE_ALLOC)
        return KLARGE_BUFFER;
    return KROUND_LARGE * ((size + KROUND_LARGE - 1) / KROUND_LARGE);
}

static int32_t cuda_malloc(Allocator *a, int small, int64_t size, int32_t pk) {
    if (a->capacity >= 0 && a->reserved + a->managed + size > a->capacity) {
        a->failed++;
        return -1;
    }
    a->reserved += size;
    a->segments++;
    int32_t bi = new_block(a, a->next_addr, size, small, pk);
    a->next_addr += size + (1LL << 20);
    return bi;
}

static void cuda_free(Allocator *a, int32_t bi) {
    remove_block(a, bi);
    a->reserved -= a->blocks[bi].size;
    drop_block(a, bi);
}

static void release_segments(Allocator *a) {
    for (int32_t pk = 0; pk < a->n_pools; pk++) {
        Pool *p = &a->pools[pk];
        for (int32_t i = p->n - 1; i >= 0; i--) {
            int32_t bi = p->e[i].block;
            Block *b = &a->blocks[bi];
            if (b->prev < 0 && b->next < 0) {
                a->reserved -= b->size;
                pool_remove_at(p, i);
                drop_block(a, bi);
            }
        }
    }
}

static int release_oversize(Allocator *a, int32_t pk, int64_t size) {
    if (!a->has_max_split)
        return 0;
    int64_t want = size < a->max_split ? a->max_split : size;
    Pool *p = &a->pools[pk];
    int32_t i = lower_bound(p, want, -1);
    if (i < p->n) {
        cuda_free(a, p->e[i].block);
        return 1;
    }
    int64_t released = 0;
    int32_t j = p->n - 1;
    while (j >= 0 && released < want && p->e[j].size >= a->max_split) {
        int64_t bsize = p->e[j].size;
        cuda_free(a, p->e[j].block);
        released += bsize;
        j--;
    }
    return released >= want;
}

static int32_t split(Allocator *a, int32_t bi, int64_t size) {
    Block *b = &a->blocks[bi];
    int64_t remaining = b->size - size;
    int do_split = b->small ? remaining >= KMIN_BLOCK_SIZE : (size < a->max_split && remaining > KSMALL_SIZE);
    if (do_split) {
        int32_t ri = new_block(a, b->addr + size, remaining, b->small, b->pool);
        if (ri < 0)
            return -1;
        b = &a->blocks[bi]; /* new_block may have moved the blocks */
        Block *rest = &a->blocks[ri];
        rest->prev = bi;
        rest->next = b->next;
        if (b->next >= 0)
            a->blocks[b->next].prev = ri;
        b->next = ri;
        b->size = size;
        insert(a, ri);
    }
    b->allocated = 1;
    a->allocated += b->size;
    return bi;
}

static int32_t malloc_block(Allocator *a, int64_t nbytes, int32_t stream) {
    int64_t size = nbytes < KMIN_BLOCK_SIZE ? KMIN_BLOCK_SIZE
                                            : KMIN_BLOCK_SIZE * ((nbytes + KMIN_BLOCK_SIZE - 1) / KMIN_BLOCK_SIZE);
    int small = size <= KSMALL_SIZE;
    int32_t pk = 2 * stream + small;
    Pool *p = &a->pools[pk];
    int32_t i = lower_bound(p, size, -1);
    int32_t bi = -1;
    if (i < p->n) {
        int64_t bsize = p->e[i].size;
        int64_t ms = a->max_split;
        if (!((size < ms && ms <= bsize) || (size >= ms && bsize >= size + KLARGE_BUFFER))) {
            bi = p->e[i].block;
            pool_remove_at(p, i);
        }
    }
    if (bi < 0) {
        int64_t alloc = allocation_size(size);
        bi = cuda_malloc(a, small, alloc, pk);
        if (bi < 0 && !a->oom_memory && release_oversize(a, pk, size))
            bi = cuda_malloc(a, small, alloc, pk);
        if (bi < 0 && !a->oom_memory) {
            a->flushes++;
            release_segments(a);
            bi = cuda_malloc(a, small, alloc, pk);
        }
        if (bi < 0)
            return -1;
    }
    return split(a, bi, size);
}

static void merge(Allocator *a, int32_t li, int32_t ri) {
    Block *left = &a->blocks[li], *right = &a->blocks[ri];
    left->size += right->size;
    left->next = right->next;
    if (right->next >= 0)
        a->blocks[right->next].prev = li;
    drop_block(a, ri);
}

static void free_block(Allocator *a, int32_t bi) {
    Block *b = &a->blocks[bi];
    b->allocated = 0;
    a->allocated -= b->size;
    int32_t prev = b->prev;
    if (prev >= 0 && !a->blocks[prev].allocated) {
        remove_block(a, prev);
        merge(a, prev, bi);
        bi = prev;
    }
    int32_t after = a->blocks[bi].next;
    if (after >= 0 && !a->blocks[after].allocated) {
        remove_block(a, after);
        merge(a, bi, after);
    }
    insert(a, bi);
}

/* The replay. events[2*i], events[2*i + 1]: (is_alloc, key) of event i; sizes[k], kinds[k], cat[k]: allocation k's
 * bytes, kind and category index (< n_cats); stream[k]: its stream as a dense index (< n_streams; NULL: all 0).
 * capacity -1: none; max_split -1: none. timelines: allocated/reserved after each event into tl_alloc, tl_res.
 * breakdown[n_cats]: block bytes (managed: requested bytes) by category at the allocated peak; present[n_cats]: 1
 * where an allocation of the category is live there (its bytes may add up to 0, or less for a managed size < 0). */
int bf_replay(int64_t n_events, const int64_t *events, int64_t n_allocs, const int64_t *sizes,
              const uint8_t *kinds, const int32_t *cat, int32_t n_cats, const int32_t *stream, int32_t n_streams,
              int64_t capacity, int64_t max_split, int timelines, int64_t *tl_alloc, int64_t *tl_res, int64_t *out,
              int64_t *breakdown, uint8_t *present) {
    Allocator a;
    memset(&a, 0, sizeof a);
    a.free_list = -1;
    a.capacity = capacity;
    a.has_max_split = max_split >= 0;
    a.max_split = max_split >= 0 ? max_split : NO_SPLIT_LIMIT;
    a.next_addr = 1LL << 20;
    a.n_pools = 2 * (n_streams > 0 ? n_streams : 1);
    a.pools = calloc((size_t)a.n_pools, sizeof(Pool));
    int32_t *live = malloc((size_t)(n_allocs > 0 ? n_allocs : 1) * sizeof(int32_t));
    int64_t *block_size = calloc((size_t)(n_allocs > 0 ? n_allocs : 1), sizeof(int64_t));
    uint8_t *skipped = calloc((size_t)(n_allocs > 0 ? n_allocs : 1), 1);
    int rc = OK;
    int64_t alloc_peak = 0, reserved_peak = 0, peak_event = 0, oom = -1, managed_peak = 0, device_peak = 0;
    int64_t i = 0;
    for (int32_t c = 0; c < OUT_SLOTS; c++)
        out[c] = 0;
    if (!a.pools || !live || !block_size || !skipped) {
        rc = ERR_MEMORY;
        goto done;
    }
    for (int64_t k = 0; k < n_allocs; k++) {
        live[k] = -1;
        if (sizes[k] > SAFE_BYTES || sizes[k] < -SAFE_BYTES)
            rc = ERR_SIZE_RANGE;
    }
    if (capacity > SAFE_BYTES || max_split > SAFE_BYTES)
        rc = ERR_SIZE_RANGE;
    if (rc != OK) {
        i = 0;
        goto failed;
    }
    for (i = 0; i < n_events; i++) {
        int is_alloc = events[2 * i] != 0;
        int64_t k = events[2 * i + 1];
        if (k < 0 || k >= n_allocs) {
            rc = ERR_KEY_RANGE;
            break;
        }
        uint8_t kind = kinds[k];
        if (kind == KIND_MANAGED) {
            if (is_alloc) {
                if (capacity >= 0 && a.reserved + a.managed + sizes[k] > capacity) {
                    oom = i;
                    break;
                }
                a.managed += sizes[k];
                if (a.managed > managed_peak)
                    managed_peak = a.managed;
                if (a.reserved + a.managed > device_peak)
                    device_peak = a.reserved + a.managed;
            } else {
                a.managed -= sizes[k];
            }
            if (timelines) {
                tl_alloc[i] = a.allocated;
                tl_res[i] = a.reserved;
            }
            continue;
        }
        int32_t bi = -1;
        if (is_alloc) {
            if (live[k] >= 0 || skipped[k]) {
                rc = ERR_TWICE;
                break;
            }
            int64_t nbytes = sizes[k];
            if (nbytes < 0) {
                rc = ERR_NEGATIVE;
                out[OUT_ERROR_VALUE] = nbytes;
                break;
            }
            int32_t s = stream ? stream[k] : 0;
            if (kind == KIND_NORMAL) {
                bi = malloc_block(&a, nbytes, s);
                if ((rc = broken(&a)) != OK)
                    break;
                if (bi < 0) {
                    oom = i;
                    break;
                }
            } else if (kind == KIND_EMPTY_CACHE) {
                release_segments(&a);
            } else {
                bi = malloc_block(&a, nbytes, s);
                if ((rc = broken(&a)) != OK)
                    break;
            }
            if (bi < 0) {
                skipped[k] = 1;
                block_size[k] = 0; /* a block it had before (freed, now skipped) is not live */
            } else {
                live[k] = bi;
                block_size[k] = a.blocks[bi].size; /* never 0: blocks are at least 512 B */
                if (a.allocated > alloc_peak) {
                    alloc_peak = a.allocated;
                    peak_event = i;
                }
                if (a.reserved > reserved_peak)
                    reserved_peak = a.reserved;
                if (a.reserved + a.managed > device_peak)
                    device_peak = a.reserved + a.managed;
            }
        } else {
            bi = live[k];
            if (bi < 0) {
                if (!skipped[k]) {
                    rc = ERR_NOT_ALLOCATED;
                    break;
                }
                skipped[k] = 0;
            } else {
                live[k] = -1;
                free_block(&a, bi);
                if ((rc = broken(&a)) != OK)
                    break;
            }
        }
        if (timelines) {
            tl_alloc[i] = a.allocated;
            tl_res[i] = a.reserved;
        }
    }
failed:
    if (rc != OK) {
        out[OUT_ERROR_EVENT] = i;
        out[OUT_ERROR_KEY] = i < n_events ? events[2 * i + 1] : -1;
        goto done;
    }
    out[OUT_EVENTS_DONE] = i;
    for (int32_t c = 0; c < n_cats; c++) {
        breakdown[c] = 0;
        present[c] = 0; /* no allocation of the category live at the peak (yet) */
    }
    if (alloc_peak) { /* what is live at the allocated peak, by category */
        uint8_t *at_peak = skipped; /* reused: cleared first */
        memset(at_peak, 0, (size_t)n_allocs);
        for (int64_t j = 0; j <= peak_event; j++)
            at_peak[events[2 * j + 1]] = events[2 * j] != 0;
        for (int64_t k = 0; k < n_allocs; k++) {
            if (!at_peak[k])
                continue;
            int64_t bytes;
            if (block_size[k])
                bytes = block_size[k];
            else if (kinds[k] == KIND_MANAGED)
                bytes = sizes[k];
            else
                continue; /* skipped: a workspace that could not be had, an empty_cache call */
            breakdown[cat[k]] += bytes;
            present[cat[k]] = 1;
        }
    }
    out[OUT_ALLOC_PEAK] = alloc_peak;
    out[OUT_RESERVED_PEAK] = reserved_peak;
    out[OUT_OOM_EVENT] = oom;
    out[OUT_PEAK_EVENT] = peak_event;
    out[OUT_SEGMENTS] = a.segments;
    out[OUT_FLUSHES] = a.flushes;
    out[OUT_FAILED] = a.failed;
    out[OUT_MANAGED_PEAK] = managed_peak;
    out[OUT_DEVICE_PEAK] = device_peak;
done:
    if (a.pools)
        for (int32_t pk = 0; pk < a.n_pools; pk++)
            free(a.pools[pk].e);
    free(a.pools);
    free(a.blocks);
    free(live);
    free(block_size);
    free(skipped);
    return rc;
}

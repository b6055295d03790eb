/* Internal to the kernel sources whose parts sit in several files: hidden visibility for the functions and tables
 * they share (kvqi_ names), so that the library's ABI stays kernels.h's. */
#ifndef KVINFER_INTERNAL_H
#define KVINFER_INTERNAL_H
#define KVQ_HIDDEN __attribute__((visibility("hidden")))
/* Long calls (kvq_matmul, kvq_kq_matmul): rows met in passes of KVQ_PASS_BYTES of activations (they stay in the
 * core's cache while the columns go by); from KVQ_RUNS_MIN_ROWS rows the columns go in KVQ_RUNS_PER_THREAD runs per
 * thread, taken by whichever thread is free (below, one per thread: short calls); from KVQ_PREP_PAR_MIN elements of
 * x its rows are rounded by every thread. None of it changes a row's arithmetic. */
#define KVQ_PASS_BYTES (512 * 1024)
#define KVQ_RUNS_PER_THREAD 4
#define KVQ_RUNS_MIN_ROWS 32
#define KVQ_PREP_PAR_MIN 32768
extern KVQ_HIDDEN int kvqi_act8; /* activations rounded to 8 bits, their lo bytes zero (kvq_activation_bits) */
/* Where the kept copies are asked for ahead of their use (kvq_prefetch_l2): into L1 (prefetcht0), or on AMD's
 * family 19h (Zen 3, Zen 4) into L2 (prefetcht1), where bursts of prefetcht0 stalled the one-row (decode) calls. */
extern KVQ_HIDDEN int kvqi_pf_l2;
#define KVQ_PREFETCH(p) (kvqi_pf_l2 ? __builtin_prefetch((p), 0, 2) : __builtin_prefetch((p), 0, 3))
#endif

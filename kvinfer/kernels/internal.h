/* Internal to the kernel sources whose parts sit in several files: hidden visibility for the functions and tables
 * they share (kvqi_ names), so that the library's ABI stays kernels.h's. */
#ifndef KVINFER_INTERNAL_H
#define KVINFER_INTERNAL_H
#define KVQ_HIDDEN __attribute__((visibility("hidden")))
extern KVQ_HIDDEN int kvqi_act8; /* activations rounded to 8 bits, their lo bytes zero (kvq_activation_bits) */
#endif

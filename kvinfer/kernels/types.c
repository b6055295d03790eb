/* kvq_type_traits: types.h's table for the Python side. */
#include "types.h"

int kvq_type_traits(int qt, int64_t *block_elems, int64_t *block_bytes) {
    const struct kvq_type *t = kvq_type(qt);
    if (!t) return KVQ_EBADTYPE;
    if (block_elems) *block_elems = t->block_elems;
    if (block_bytes) *block_bytes = t->block_bytes;
    return kvq_type_kept(qt) ? 1 : 0;
}

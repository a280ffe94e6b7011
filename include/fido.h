/* Fido — the C ABI. Link with libfido (crates/fido-capi: libfido.a or libfido.so).
 *
 * Conventions: functions return 0 on success and a negative errno-style code on
 * failure (fido_strerror() names it); handles are opaque pointers owned by the caller
 * until passed to the matching destroy function; no function keeps a pointer it was
 * given beyond the call unless its comment says so. */
#ifndef FIDO_H
#define FIDO_H

#include "fido/rpc.h"
#include "fido/pipe.h"
#include "fido/blk.h"

#endif /* FIDO_H */

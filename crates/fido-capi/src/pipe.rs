//! vPipe C ABI (`include/fido/pipe.h`).

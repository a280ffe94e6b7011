/* vPipe C ABI: see include/fido.h for conventions. */
#ifndef FIDO_PIPE_H
#define FIDO_PIPE_H
#endif

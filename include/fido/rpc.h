/* VMRPC C ABI: see include/fido.h for conventions. */
#ifndef FIDO_RPC_H
#define FIDO_RPC_H
#endif

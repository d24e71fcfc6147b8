/* SPDX-License-Identifier: MIT */
/* Internals of the PyTorch entry points (torch.c), for tests. */
#ifndef GML_TORCH_H
#define GML_TORCH_H

/* The device count PyTorch gave gmlake_torch_init(), or -1. */
int gml_torch_device_count(void);
/*
 * Destroy every device's context (live blocks die with it) and forget the
 * fractions and errors: the state of a fresh process, so that tests can
 * run one after another in one process (CK_FORK=no). 0, or -EIO if a
 * context did not destroy cleanly.
 */
int gml_torch_reset(void);

#endif

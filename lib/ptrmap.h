/* SPDX-License-Identifier: MIT */
/* An open-addressing hash map from device address to block. */
#ifndef GML_PTRMAP_H
#define GML_PTRMAP_H

#include <stddef.h>
#include <stdint.h>

struct gml_ptrmap {
	struct gml_ptrmap_slot {
		uintptr_t key;		/* 0: empty, 1: deleted */
		void *val;
	} *slots;
	size_t cap, count, used;	/* used counts deleted slots too */
};

int gml_ptrmap_put(struct gml_ptrmap *m, uintptr_t key, void *val);
void *gml_ptrmap_get(const struct gml_ptrmap *m, uintptr_t key);
void *gml_ptrmap_del(struct gml_ptrmap *m, uintptr_t key);
void gml_ptrmap_fini(struct gml_ptrmap *m);

#endif

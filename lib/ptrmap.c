/* SPDX-License-Identifier: MIT */
/*
 * Device address -> block, for free and lookups. Linear probing over a
 * power-of-two table; keys are at least 512-byte aligned, so 0 and 1 are
 * free to mark empty and deleted slots.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <errno.h>
#include <stdlib.h>

#include "ptrmap.h"

#define EMPTY 0
#define DELETED 1

static size_t slot_of(const struct gml_ptrmap *m, uintptr_t key)
{
	uint64_t h = (uint64_t)key * 0x9e3779b97f4a7c15ull;

	return (size_t)(h >> 17) & (m->cap - 1);
}

static int grow(struct gml_ptrmap *m)
{
	struct gml_ptrmap old = *m;
	size_t cap = 1024;

	/* Rehashing also drops deleted slots, so size by live keys only. */
	while (cap < (m->count + 1) * 4)
		cap *= 2;
	m->slots = calloc(cap, sizeof(*m->slots));
	if (!m->slots) {
		*m = old;
		return -ENOMEM;
	}
	m->cap = cap;
	m->count = m->used = 0;
	for (size_t i = 0; i < old.cap; i++)
		if (old.slots[i].key > DELETED)
			gml_ptrmap_put(m, old.slots[i].key, old.slots[i].val);
	free(old.slots);
	return 0;
}

int gml_ptrmap_put(struct gml_ptrmap *m, uintptr_t key, void *val)
{
	size_t i;

	if ((m->used + 1) * 4 >= m->cap * 3 && grow(m))
		return -ENOMEM;
	for (i = slot_of(m, key); m->slots[i].key > DELETED;
	     i = (i + 1) & (m->cap - 1))
		if (m->slots[i].key == key)
			return -EEXIST;
	if (m->slots[i].key == EMPTY)
		m->used++;
	m->slots[i].key = key;
	m->slots[i].val = val;
	m->count++;
	return 0;
}

static struct gml_ptrmap_slot *find(const struct gml_ptrmap *m, uintptr_t key)
{
	if (!m->cap || key <= DELETED)
		return NULL;
	for (size_t i = slot_of(m, key); m->slots[i].key != EMPTY;
	     i = (i + 1) & (m->cap - 1))
		if (m->slots[i].key == key)
			return &m->slots[i];
	return NULL;
}

void *gml_ptrmap_get(const struct gml_ptrmap *m, uintptr_t key)
{
	struct gml_ptrmap_slot *s = find(m, key);

	return s ? s->val : NULL;
}

void *gml_ptrmap_del(struct gml_ptrmap *m, uintptr_t key)
{
	struct gml_ptrmap_slot *s = find(m, key);
	void *val;

	if (!s)
		return NULL;
	val = s->val;
	s->key = DELETED;
	s->val = NULL;
	m->count--;
	return val;
}

void gml_ptrmap_fini(struct gml_ptrmap *m)
{
	free(m->slots);
	m->slots = NULL;
	m->cap = m->count = m->used = 0;
}

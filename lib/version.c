/* SPDX-License-Identifier: MIT */
/* Runtime version queries. */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include "error.h"

GML_EXPORT int gmlake_version_major(void)
{
	return GMLAKE_VERSION_MAJOR;
}

GML_EXPORT int gmlake_version_minor(void)
{
	return GMLAKE_VERSION_MINOR;
}

GML_EXPORT bool gmlake_check_version(int major, int minor)
{
	if (major != GMLAKE_VERSION_MAJOR)
		return major < GMLAKE_VERSION_MAJOR;
	return minor <= GMLAKE_VERSION_MINOR;
}

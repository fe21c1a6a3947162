/* Input for regen.sh: the two public libpsm2 headers bound by psm-sys. */
#include <psm2.h>
#include <psm2_mq.h>

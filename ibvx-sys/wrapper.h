/*
 * Input of ibvx-sys/regen.sh (bindgen). Not compiled at build time.
 *
 * Besides the verbs header itself, it declares one function-pointer typedef,
 * `pfn_<symbol>`, per libibverbs entry point that ibvx-sys loads with dlvsym.
 * src/lib.rs checks at compile time that each hand-written `Verbs` field has
 * exactly that type, so a signature change in verbs.h shows up as a build
 * error after regeneration instead of as a silent ABI mismatch.
 *
 * `ibv_query_port` and `ibv_reg_mr` are also function-like macros in verbs.h;
 * naming them without parentheses refers to the exported functions, which is
 * what dlvsym returns (e.g. ibv_query_port takes `struct _compat_ibv_port_attr *`).
 */
#include <infiniband/verbs.h>

#define IBVX_PFN(sym) typedef __typeof__(sym) *pfn_##sym;

IBVX_PFN(ibv_get_device_list)
IBVX_PFN(ibv_free_device_list)
IBVX_PFN(ibv_get_device_name)
IBVX_PFN(ibv_get_device_guid)
IBVX_PFN(ibv_open_device)
IBVX_PFN(ibv_close_device)
IBVX_PFN(ibv_query_device)
IBVX_PFN(ibv_query_port)
IBVX_PFN(ibv_query_gid)
IBVX_PFN(_ibv_query_gid_ex)
IBVX_PFN(ibv_query_pkey)
IBVX_PFN(ibv_alloc_pd)
IBVX_PFN(ibv_dealloc_pd)
IBVX_PFN(ibv_reg_mr)
IBVX_PFN(ibv_reg_mr_iova2)
IBVX_PFN(ibv_dereg_mr)
IBVX_PFN(ibv_create_comp_channel)
IBVX_PFN(ibv_destroy_comp_channel)
IBVX_PFN(ibv_create_cq)
IBVX_PFN(ibv_resize_cq)
IBVX_PFN(ibv_destroy_cq)
IBVX_PFN(ibv_get_cq_event)
IBVX_PFN(ibv_ack_cq_events)
IBVX_PFN(ibv_create_qp)
IBVX_PFN(ibv_destroy_qp)
IBVX_PFN(ibv_modify_qp)
IBVX_PFN(ibv_query_qp)
IBVX_PFN(ibv_create_srq)
IBVX_PFN(ibv_modify_srq)
IBVX_PFN(ibv_query_srq)
IBVX_PFN(ibv_destroy_srq)
IBVX_PFN(ibv_get_async_event)
IBVX_PFN(ibv_ack_async_event)
IBVX_PFN(ibv_wc_status_str)
IBVX_PFN(ibv_port_state_str)
IBVX_PFN(ibv_event_type_str)
IBVX_PFN(ibv_node_type_str)
IBVX_PFN(ibv_fork_init)

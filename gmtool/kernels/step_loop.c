/* gmtool's native step loop: one call per piecewise step launches its graphs and Triton kernels in order.
 *
 * A program is an ordered list of ops, built once per captured entry by gmtool/kernels/native_loop.py:
 * GRAPH (a CUgraphExec) and KERNEL (a CUfunction, its launch shape and a packed parameter buffer with the void*
 * array pointing into it). What follows the step is given per call: up to GMT_VALUES ints (the step's grid and
 * num_seqs, ForwardContext.prepare), which a kernel op takes as grid dimensions and patches into its parameter
 * buffer. No CUDA header and no link to libcuda: the few types are declared here, and the driver's entry
 * points (cuGraphLaunch, cuLaunchKernel) are handed in by the caller, so tests hand in fakes that record.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define GMT_VALUES 4 /* per-step values one call takes */

enum { GMT_GRAPH = 0, GMT_KERNEL = 1 };

/* what gmt_run returns besides the driver's own codes (CUresult, >= 0: 0 is success) */
enum {
    GMT_EMPTY_GRID = -1, /* a grid dimension from the step is < 1: nothing was launched, the caller runs it */
    GMT_INT_RANGE = -2,  /* a patched value does not fit its parameter: nothing was launched */
    GMT_BAD_PROGRAM = -3 /* an op refers to a value or kind that does not exist: nothing was launched */
};

typedef int (*gmt_graph_launch)(void *exec, void *stream); /* cuGraphLaunch */
typedef int (*gmt_kernel_launch)(void *function, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                 unsigned by, unsigned bz, unsigned shared, void *stream, void **params,
                                 void **extra); /* cuLaunchKernel */

typedef struct {
    int32_t kind;           /* GMT_GRAPH or GMT_KERNEL */
    uint32_t block_x;       /* threads per block: 32 * num_warps */
    uint32_t shared;        /* dynamic shared memory bytes */
    int32_t grid_value[3];  /* >= 0: that step value is the dimension; < 0: grid_const */
    uint32_t grid_const[3];
    int32_t first_patch;    /* this op's rows of the patch table */
    int32_t num_patches;
    void *handle;           /* CUgraphExec or CUfunction */
    void **params;          /* kernel: one pointer per parameter, into its packed buffer */
} gmt_op;

typedef struct {
    void *dst;     /* the parameter's bytes in the packed buffer */
    int32_t size;  /* 4: int32, 8: int64 */
    int32_t value; /* the step value written there */
} gmt_patch;

typedef struct {
    gmt_graph_launch graph_launch;
    gmt_kernel_launch kernel_launch;
    const gmt_op *ops;
    const gmt_patch *patches;
    int32_t num_ops;
    int32_t failed_op; /* out: the op a driver call failed on */
    int32_t error;     /* out: that call's code */
} gmt_program;

int gmt_abi_version(void) { return 1; }

/* Every check first, then every launch: a step the loop refuses has launched nothing, so the caller can run
 * it the Python way instead (a planned step with no sequence zeroes its output there). */
static int check(const gmt_program *p, const int64_t *v) {
    for (int32_t i = 0; i < p->num_ops; i++) {
        const gmt_op *op = &p->ops[i];
        if (op->kind == GMT_GRAPH)
            continue;
        if (op->kind != GMT_KERNEL)
            return GMT_BAD_PROGRAM;
        for (int d = 0; d < 3; d++) {
            int32_t k = op->grid_value[d];
            if (k >= GMT_VALUES)
                return GMT_BAD_PROGRAM;
            if (k >= 0 && (v[k] < 1 || v[k] > (int64_t)UINT32_MAX))
                return GMT_EMPTY_GRID;
        }
        for (int32_t j = op->first_patch; j < op->first_patch + op->num_patches; j++) {
            const gmt_patch *pt = &p->patches[j];
            if (pt->value < 0 || pt->value >= GMT_VALUES || (pt->size != 4 && pt->size != 8))
                return GMT_BAD_PROGRAM;
            if (pt->size == 4 && (v[pt->value] < INT32_MIN || v[pt->value] > INT32_MAX))
                return GMT_INT_RANGE;
        }
    }
    return 0;
}

int gmt_run(gmt_program *p, void *stream, int64_t v0, int64_t v1, int64_t v2, int64_t v3) {
    const int64_t v[GMT_VALUES] = {v0, v1, v2, v3};
    int rc = check(p, v);
    if (rc != 0)
        return rc;
    for (int32_t i = 0; i < p->num_ops; i++) {
        const gmt_op *op = &p->ops[i];
        if (op->kind == GMT_GRAPH) {
            rc = p->graph_launch(op->handle, stream);
        } else {
            for (int32_t j = op->first_patch; j < op->first_patch + op->num_patches; j++) {
                const gmt_patch *pt = &p->patches[j];
                if (pt->size == 4) {
                    int32_t x = (int32_t)v[pt->value];
                    memcpy(pt->dst, &x, 4);
                } else {
                    memcpy(pt->dst, &v[pt->value], 8);
                }
            }
            unsigned g[3];
            for (int d = 0; d < 3; d++)
                g[d] = op->grid_value[d] >= 0 ? (unsigned)v[op->grid_value[d]] : op->grid_const[d];
            rc = p->kernel_launch(op->handle, g[0], g[1], g[2], op->block_x, 1, 1, op->shared, stream, op->params,
                                  NULL);
        }
        if (rc != 0) {
            p->failed_op = i;
            p->error = rc;
            return rc;
        }
    }
    return 0;
}

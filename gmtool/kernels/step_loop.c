/* gmtool's native step loop: one call per piecewise step launches its graphs and Triton kernels in order.
 *
 * A program is an ordered list of ops, built once per captured entry by gmtool/kernels/native_loop.py:
 * GRAPH (a CUgraphExec) and KERNEL (a CUfunction, its launch shape and a packed parameter buffer with the void*
 * array pointing into it). What follows the step is given per call: up to GMT_VALUES ints (the step's grid and
 * num_seqs, ForwardContext.prepare), which a kernel op takes as grid dimensions and patches into its parameter
 * buffer. No CUDA header and no link to libcuda: the few types are declared here, and the driver's entry
 * points (cuGraphLaunch, cuLaunchKernel, cuGraphExecKernelNodeSetParams) are handed in by the caller, so tests
 * hand in fakes that record.
 *
 * Stitched: where the caller built one graph of all the ops (the pieces as child graphs, each kernel as a kernel
 * node: native_loop.stitch), a step is that graph's one launch. Its kernel nodes take the step's values
 * (cuGraphExecKernelNodeSetParams: grid and patched parameters, copied by the driver, applied from the next
 * launch on) only when they differ from the values last applied: a run of steps of one shape sets nothing.
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

typedef struct { /* CUDA_KERNEL_NODE_PARAMS_v2; the v1 entry point reads its first fields, the same */
    void *func;
    unsigned grid[3];
    unsigned block[3];
    unsigned shared;
    void **params;
    void **extra;
    void *kern;
    void *ctx;
} gmt_node_params;

typedef int (*gmt_node_set)(void *exec, void *node, const gmt_node_params *p); /* cuGraphExecKernelNodeSetParams */
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
    void *node;             /* kernel, stitched: its node in the stitched graph */
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
    int32_t failed_op; /* out: the op a driver call failed on; num_ops: the stitched graph's launch */
    int32_t error;     /* out: that call's code */
    gmt_node_set node_set;
    void *stitched;         /* the CUgraphExec of all ops, or NULL: each op launched on its own */
    int64_t applied[GMT_VALUES]; /* the values the stitched graph's kernel nodes hold */
    int32_t applied_valid;
    int32_t node_sets;      /* out: kernel nodes set so far (counted: tests, benchmarks) */
} gmt_program;

int gmt_abi_version(void) { return 2; }

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

/* A kernel op's step values into its packed parameters, and its grid. */
static void shape(const gmt_op *op, const gmt_patch *patches, const int64_t *v, unsigned g[3]) {
    for (int32_t j = op->first_patch; j < op->first_patch + op->num_patches; j++) {
        const gmt_patch *pt = &patches[j];
        if (pt->size == 4) {
            int32_t x = (int32_t)v[pt->value];
            memcpy(pt->dst, &x, 4);
        } else {
            memcpy(pt->dst, &v[pt->value], 8);
        }
    }
    for (int d = 0; d < 3; d++)
        g[d] = op->grid_value[d] >= 0 ? (unsigned)v[op->grid_value[d]] : op->grid_const[d];
}

static int fail(gmt_program *p, int32_t op, int rc) {
    p->failed_op = op;
    p->error = rc;
    return rc;
}

static int run_stitched(gmt_program *p, void *stream, const int64_t *v) {
    if (!p->applied_valid || memcmp(p->applied, v, sizeof p->applied) != 0) {
        p->applied_valid = 0; /* a failure part-way leaves nodes of both steps: set them all next time */
        for (int32_t i = 0; i < p->num_ops; i++) {
            const gmt_op *op = &p->ops[i];
            if (op->kind != GMT_KERNEL)
                continue;
            gmt_node_params np;
            memset(&np, 0, sizeof np);
            shape(op, p->patches, v, np.grid);
            np.func = op->handle;
            np.block[0] = op->block_x;
            np.block[1] = np.block[2] = 1;
            np.shared = op->shared;
            np.params = op->params;
            int rc = p->node_set(p->stitched, op->node, &np);
            if (rc != 0)
                return fail(p, i, rc);
            p->node_sets++;
        }
        memcpy(p->applied, v, sizeof p->applied);
        p->applied_valid = 1;
    }
    int rc = p->graph_launch(p->stitched, stream);
    return rc != 0 ? fail(p, p->num_ops, rc) : 0;
}

int gmt_run(gmt_program *p, void *stream, int64_t v0, int64_t v1, int64_t v2, int64_t v3) {
    const int64_t v[GMT_VALUES] = {v0, v1, v2, v3};
    int rc = check(p, v);
    if (rc != 0)
        return rc;
    if (p->stitched != NULL)
        return run_stitched(p, stream, v);
    for (int32_t i = 0; i < p->num_ops; i++) {
        const gmt_op *op = &p->ops[i];
        if (op->kind == GMT_GRAPH) {
            rc = p->graph_launch(op->handle, stream);
        } else {
            unsigned g[3];
            shape(op, p->patches, v, g);
            rc = p->kernel_launch(op->handle, g[0], g[1], g[2], op->block_x, 1, 1, op->shared, stream, op->params,
                                  NULL);
        }
        if (rc != 0)
            return fail(p, i, rc);
    }
    return 0;
}

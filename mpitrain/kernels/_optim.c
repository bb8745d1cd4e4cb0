/* The async server's optimizer updates (mpitrain/models/optim.py), each one fused pass
 * over the flat vectors. numpy makes a pass per operation and allocates temporaries
 * (SGD 2 passes, momentum 4, Nesterov 6, Adam 9 and two 4-byte-per-value
 * temporaries), and each numpy call costs a fixed dispatch, which dominates at LR's
 * size; AlexNet's Adam streams its 110 MB vectors a dozen times (docs/architecture.md,
 * "Flat optimizers in C"). The same for the delay compensation of a stale gradient
 * (--staleness-compensation dc).
 *
 * Same bits as the numpy code: each value goes through exactly its float32 operations,
 * in its order (every product, sum, quotient and square root rounded to float32 as
 * numpy rounds it: IEEE, correctly rounded), compiled without fused multiply-adds
 * (-ffp-contract=off in setup.py) and without reassociation (no -ffast-math). The
 * caller passes its float32 scalars (learning rate, 1 - beta, ...) already computed as
 * numpy computes them. tests/unit/test_optim.py compares both paths bit for bit.
 * Every function checks its buffers' sizes and releases the GIL. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <string.h>

/* An AVX2 copy of each loop where the CPU has it (8 values per instruction; chosen at
 * load time, GCC's function multiversioning), SSE2 otherwise. AVX2 brings no fused
 * multiply-add (that is FMA, another flag; contraction is off anyway). */
#define WIDE __attribute__((target_clones("avx2", "default")))

/* w -= g * lr */
WIDE static void sgd(float *restrict w, const float *restrict g, float lr, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++)
        w[i] = w[i] - g[i] * lr;
}

/* v = v * momentum - g * lr; w += v */
WIDE static void momentum(float *restrict w, const float *restrict g, float *restrict v,
                     float lr, float mu, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        float vi = v[i] * mu - g[i] * lr;
        v[i] = vi;
        w[i] = w[i] + vi;
    }
}

/* Nesterov: v = v * momentum - g * lr; w += v * momentum - g * lr */
WIDE static void nesterov(float *restrict w, const float *restrict g, float *restrict v,
                          float lr, float mu, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        float step = g[i] * lr;
        float vi = v[i] * mu - step;
        v[i] = vi;
        w[i] = w[i] + (vi * mu - step);
    }
}

/* m += (g - m) * c1; v += (g * g - v) * c2; w -= m / (sqrt(v) + eps) * alpha */
WIDE static void adam(float *restrict w, const float *restrict g, float *restrict m,
                 float *restrict v, float c1, float c2, float eps, float alpha, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        float gi = g[i];
        float mi = m[i] + (gi - m[i]) * c1;
        float vi = v[i] + (gi * gi - v[i]) * c2;
        m[i] = mi;
        v[i] = vi;
        w[i] = w[i] - (mi / (sqrtf(vi) + eps)) * alpha;
    }
}

/* DC-ASGD-a's correction of a stale gradient (mpitrain/train/asynchronous/compensation.py):
 * ms = ms * m + (g * g) * c; g += (w - w_read) * g * g * lam / sqrt(ms + eps) */
WIDE static void delay_compensate(float *restrict g, float *restrict ms,
                                  const float *restrict w, const float *restrict wr,
                                  float m, float c, float lam, float eps, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        float gi = g[i];
        float msi = ms[i] * m + (gi * gi) * c;
        ms[i] = msi;
        g[i] = gi + (((w[i] - wr[i]) * gi) * gi) * lam / sqrtf(msi + eps);
    }
}

static void release(Py_buffer *views, int k) {
    for (int j = 0; j < k; j++) PyBuffer_Release(&views[j]);
}

static int is_float32(const Py_buffer *view) {
    const char *f = view->format;
    return view->itemsize == 4 && f != NULL && (strcmp(f, "f") == 0 || strcmp(f, "<f") == 0
                                                || strcmp(f, "=f") == 0);
}

/* The buffers of ``objs``: C-contiguous float32, all of the same length, the first
 * ``writable`` of them writable; or -1 with an exception set (none held). */
static int float_buffers(PyObject **objs, Py_buffer *views, int k, int writable,
                         const char *fn) {
    for (int j = 0; j < k; j++) {
        int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (j < writable ? PyBUF_WRITABLE : 0);
        if (PyObject_GetBuffer(objs[j], &views[j], flags) < 0) {
            release(views, j);
            return -1;
        }
        if (!is_float32(&views[j]) || views[j].len != views[0].len) {
            PyErr_Format(PyExc_ValueError, "%s: every vector must be float32, of one length",
                         fn);
            release(views, j + 1);
            return -1;
        }
    }
    return 0;
}

static PyObject *py_sgd(PyObject *self, PyObject *args) {
    PyObject *objs[2];
    float lr;
    Py_buffer b[2];
    if (!PyArg_ParseTuple(args, "OOf", &objs[0], &objs[1], &lr)
            || float_buffers(objs, b, 2, 1, "sgd") < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    sgd(b[0].buf, b[1].buf, lr, b[0].len / 4);
    Py_END_ALLOW_THREADS
    release(b, 2);
    Py_RETURN_NONE;
}

static PyObject *py_momentum(PyObject *self, PyObject *args) {
    PyObject *objs[3];  /* weights, grad, velocity */
    float lr, mu;
    int look_ahead = 0;  /* Nesterov's */
    Py_buffer b[3];
    if (!PyArg_ParseTuple(args, "OOOff|p", &objs[0], &objs[1], &objs[2], &lr, &mu,
                          &look_ahead))
        return NULL;
    PyObject *ordered[3] = {objs[0], objs[2], objs[1]};  /* the writable ones first */
    if (float_buffers(ordered, b, 3, 2, "momentum") < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    if (look_ahead)
        nesterov(b[0].buf, b[2].buf, b[1].buf, lr, mu, b[0].len / 4);
    else
        momentum(b[0].buf, b[2].buf, b[1].buf, lr, mu, b[0].len / 4);
    Py_END_ALLOW_THREADS
    release(b, 3);
    Py_RETURN_NONE;
}

static PyObject *py_adam(PyObject *self, PyObject *args) {
    PyObject *objs[4];  /* weights, grad, m, v */
    float c1, c2, eps, alpha;
    Py_buffer b[4];
    if (!PyArg_ParseTuple(args, "OOOOffff", &objs[0], &objs[1], &objs[2], &objs[3], &c1, &c2,
                          &eps, &alpha))
        return NULL;
    PyObject *ordered[4] = {objs[0], objs[2], objs[3], objs[1]};  /* writable first */
    if (float_buffers(ordered, b, 4, 3, "adam") < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    adam(b[0].buf, b[3].buf, b[1].buf, b[2].buf, c1, c2, eps, alpha, b[0].len / 4);
    Py_END_ALLOW_THREADS
    release(b, 4);
    Py_RETURN_NONE;
}

static PyObject *py_delay_compensate(PyObject *self, PyObject *args) {
    PyObject *objs[4];  /* grad, mean square, weights, weights read */
    float m, c, lam, eps;
    Py_buffer b[4];
    if (!PyArg_ParseTuple(args, "OOOOffff", &objs[0], &objs[1], &objs[2], &objs[3], &m, &c,
                          &lam, &eps)
            || float_buffers(objs, b, 4, 2, "delay_compensate") < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    delay_compensate(b[0].buf, b[1].buf, b[2].buf, b[3].buf, m, c, lam, eps, b[0].len / 4);
    Py_END_ALLOW_THREADS
    release(b, 4);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"sgd", py_sgd, METH_VARARGS, "sgd(weights, grad, lr): weights -= grad * lr"},
    {"momentum", py_momentum, METH_VARARGS,
     "momentum(weights, grad, velocity, lr, momentum, nesterov=False): v = v * momentum - "
     "grad * lr; weights += v, or with nesterov weights += v * momentum - grad * lr"},
    {"adam", py_adam, METH_VARARGS,
     "adam(weights, grad, m, v, 1 - beta_1, 1 - beta_2, epsilon, alpha): Keras' Adam step "
     "with alpha the bias-corrected step size"},
    {"delay_compensate", py_delay_compensate, METH_VARARGS,
     "delay_compensate(grad, ms, w, w_read, m, 1 - m, lambda, eps): ms = ms * m + grad^2 "
     "(1 - m); grad += (w - w_read) grad^2 lambda / sqrt(ms + eps) (DC-ASGD-a)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_optim", NULL, -1, methods};

PyMODINIT_FUNC PyInit__optim(void) { return PyModule_Create(&module); }

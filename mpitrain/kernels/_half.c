/* float32 <-> float16 conversions for --compression fp16, one pass each, with the
 * x86 F16C instructions (8 values per instruction). numpy converts float16 one value
 * at a time, an order of magnitude slower than this (docs/architecture.md, "float16
 * conversions in C"),
 * which made compression slower than the bytes it saved. Every function
 * checks its buffers' sizes, releases the GIL, and is used only when the CPU has
 * F16C (mpitrain/kernels/half.py falls back to numpy otherwise). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>
#include <stdint.h>

#define F16C __attribute__((target("avx,f16c")))

F16C static void widen(const uint16_t *src, float *dst, Py_ssize_t n) {
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
    for (; i < n; i++)
        dst[i] = _cvtsh_ss(src[i]);
}

/* out16 = half(values + residual); residual = (values + residual) - float(out16) */
F16C static void encode(const float *values, float *residual, uint16_t *out, Py_ssize_t n) {
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_add_ps(_mm256_loadu_ps(values + i), _mm256_loadu_ps(residual + i));
        __m128i h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
        _mm_storeu_si128((__m128i *)(out + i), h);
        _mm256_storeu_ps(residual + i, _mm256_sub_ps(v, _mm256_cvtph_ps(h)));
    }
    for (; i < n; i++) {
        float v = values[i] + residual[i];
        out[i] = _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT);
        residual[i] = v - _cvtsh_ss(out[i]);
    }
}

/* out16[j] = half(scale * sum over rows k of float(rows16[k][j])), rows in order */
F16C static void mean_rows(const uint16_t *rows, Py_ssize_t k, Py_ssize_t n, float scale,
                           uint16_t *out) {
    const __m256 s = _mm256_set1_ps(scale);
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 acc = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rows + i)));
        for (Py_ssize_t r = 1; r < k; r++)
            acc = _mm256_add_ps(acc, _mm256_cvtph_ps(
                _mm_loadu_si128((const __m128i *)(rows + r * n + i))));
        _mm_storeu_si128((__m128i *)(out + i),
                         _mm256_cvtps_ph(_mm256_mul_ps(acc, s), _MM_FROUND_TO_NEAREST_INT));
    }
    for (; i < n; i++) {
        float acc = _cvtsh_ss(rows[i]);
        for (Py_ssize_t r = 1; r < k; r++)
            acc += _cvtsh_ss(rows[r * n + i]);
        out[i] = _cvtss_sh(acc * scale, _MM_FROUND_TO_NEAREST_INT);
    }
}

static int writable(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (view->len % itemsize) {
        PyErr_Format(PyExc_ValueError, "%s: not a buffer of %zd-byte items", name, itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *py_widen(PyObject *self, PyObject *args) {
    PyObject *a, *b;
    Py_buffer src, dst;
    if (!PyArg_ParseTuple(args, "OO", &a, &b) || writable(a, &src, 2, "half") < 0)
        return NULL;
    if (writable(b, &dst, 4, "out") < 0) { PyBuffer_Release(&src); return NULL; }
    Py_ssize_t n = src.len / 2;
    if (dst.len / 4 != n)
        PyErr_SetString(PyExc_ValueError, "widen: half and out differ in length");
    else {
        Py_BEGIN_ALLOW_THREADS
        widen(src.buf, dst.buf, n);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_encode(PyObject *self, PyObject *args) {
    PyObject *a, *b, *c;
    Py_buffer values, residual, out;
    if (!PyArg_ParseTuple(args, "OOO", &a, &b, &c) || writable(a, &values, 4, "values") < 0)
        return NULL;
    if (writable(b, &residual, 4, "residual") < 0) { PyBuffer_Release(&values); return NULL; }
    if (writable(c, &out, 2, "out") < 0) {
        PyBuffer_Release(&values); PyBuffer_Release(&residual); return NULL;
    }
    Py_ssize_t n = residual.len / 4;
    if (values.len / 4 < n || out.len / 2 < n)
        PyErr_SetString(PyExc_ValueError, "encode: values or out shorter than residual");
    else {
        Py_BEGIN_ALLOW_THREADS
        encode(values.buf, residual.buf, out.buf, n);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&values);
    PyBuffer_Release(&residual);
    PyBuffer_Release(&out);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_mean_rows(PyObject *self, PyObject *args) {
    PyObject *a, *b;
    Py_ssize_t k;
    float scale;
    Py_buffer rows, out;
    if (!PyArg_ParseTuple(args, "OnfO", &a, &k, &scale, &b) || writable(a, &rows, 2, "rows") < 0)
        return NULL;
    if (writable(b, &out, 2, "out") < 0) { PyBuffer_Release(&rows); return NULL; }
    Py_ssize_t n = out.len / 2;
    if (k < 1 || rows.len / 2 != k * n)
        PyErr_SetString(PyExc_ValueError, "mean_rows: rows is not k rows of len(out)");
    else {
        Py_BEGIN_ALLOW_THREADS
        mean_rows(rows.buf, k, n, scale, out.buf);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&rows);
    PyBuffer_Release(&out);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_supported(PyObject *self, PyObject *args) {
    __builtin_cpu_init();
    return PyBool_FromLong(__builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx"));
}

static PyMethodDef methods[] = {
    {"widen", py_widen, METH_VARARGS, "widen(half16, out32): out = float32(half)"},
    {"encode", py_encode, METH_VARARGS,
     "encode(values32, residual32, out16): out = half(values + residual), residual keeps "
     "what the cast lost (the first len(residual) values)"},
    {"mean_rows", py_mean_rows, METH_VARARGS,
     "mean_rows(rows16, k, scale, out16): out = half(scale * sum of the k rows, in order)"},
    {"supported", py_supported, METH_NOARGS, "whether this CPU has F16C and AVX"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_half", NULL, -1, methods};

PyMODINIT_FUNC PyInit__half(void) { return PyModule_Create(&module); }

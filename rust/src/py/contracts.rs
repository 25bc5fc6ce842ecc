//! The contracts both planes keep, declared once in the data plane and read by the control
//! plane: the error table and the error body, the inference and disaggregation paths, the
//! prefill leg's body, where a request's key is read from, and its id.

use std::collections::HashMap;

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::edge::answer::{envelope, ERRORS};
use crate::edge::{self, keys, prefill_body, PdProtocol, INFERENCE_PATHS};
use crate::headers::header_map;

/// One error answer: (status, `OpenAI` type, code, default `Retry-After`).
type ErrorEntry = (u16, &'static str, &'static str, Option<u32>);

pub(crate) fn add(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let errors: HashMap<&str, ErrorEntry> =
        ERRORS.iter().map(|(name, f)| (*name, (f.status, f.kind, f.code, f.retry_after))).collect();
    m.add("ERRORS", errors)?;
    m.add("INFERENCE_PATHS", pyo3::types::PyTuple::new(m.py(), INFERENCE_PATHS)?)?;
    let pd_paths: HashMap<&str, Vec<&str>> = PdProtocol::ALL.iter().map(|p| (p.name(), p.paths().to_vec())).collect();
    m.add("PD_PATHS", pd_paths)?;
    m.add_function(wrap_pyfunction!(pd_prefill_body, m)?)?;
    m.add_function(wrap_pyfunction!(error_body, m)?)?;
    m.add_function(wrap_pyfunction!(client_key, m)?)?;
    m.add_function(wrap_pyfunction!(request_id, m)?)?;
    Ok(())
}

/// The id of a request with these headers: its own `x-request-id`, else a new one, as the edge
/// gives its answers.
#[pyfunction]
fn request_id(py: Python<'_>, headers: Vec<(Vec<u8>, Vec<u8>)>) -> Bound<'_, PyBytes> {
    PyBytes::new(py, edge::request_id(&header_map(&headers)).0.as_bytes())
}

/// The key a request with these headers carries (`Authorization: Bearer KEY`, else
/// `x-api-key: KEY`), as the edge reads it.
#[pyfunction]
fn client_key(py: Python<'_>, headers: Vec<(Vec<u8>, Vec<u8>)>) -> Option<Bound<'_, PyBytes>> {
    keys::client_key(&header_map(&headers)).map(|key| PyBytes::new(py, key))
}

/// The `OpenAI` error envelope every error answer of the proxy carries.
#[pyfunction]
#[pyo3(signature = (message, kind, code, param=None))]
fn error_body<'py>(py: Python<'py>, message: &str, kind: &str, code: &str, param: Option<&str>) -> Bound<'py, PyBytes> {
    PyBytes::new(py, envelope(message, kind, code, param).as_bytes())
}

/// The prefill leg's body for `protocol`, from the client's `body` sent to `path`.
#[pyfunction]
fn pd_prefill_body<'py>(py: Python<'py>, protocol: &str, path: &str, body: &[u8]) -> PyResult<Bound<'py, PyBytes>> {
    let protocol = PdProtocol::parse(protocol)?;
    let patched = prefill_body(protocol, path, body)?;
    Ok(PyBytes::new(py, &patched))
}

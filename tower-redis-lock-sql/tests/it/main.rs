//! The integration tests, in one binary (each binary links the crates
//! again): the crash tests and the layer over a SQL store over real HTTP
//! (`exactly_once`), and what the `exactly_once` example prints
//! (`examples`). Shared helpers in `common`.

mod common;
mod exactly_once;
mod examples;

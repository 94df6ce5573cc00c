//! Tests of the SQL stores.

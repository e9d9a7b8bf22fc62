"""Simulation at paper scale: a latency-model engine and trainer that sleep scaled time, so the
real controller and Dask dataflow run workload W3 (7B-class, 20K-token long tail) on a laptop.
Every number they produce is *simulated*; reports say so."""

"""The job graph built by the public API, and its compilation into stages the engine runs."""

# Bad input to `strata train` and `strata report` (uses strata_flag_error_test).

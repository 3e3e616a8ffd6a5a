# Bad input to `strata bench cpu-adam`, `strata bench offload` and `strata plan` (uses strata_flag_error_test).

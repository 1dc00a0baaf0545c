"""Alias of run_all.py under the `bench_*.py` name that `make bench` lists; same flags."""

from run_all import main

if __name__ == "__main__":
    main()

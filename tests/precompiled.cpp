// The translation unit that owns the tests' precompiled header (zb_test_pch, tests/CMakeLists.txt),
// compiled with the flags every test binary shares and nothing else.

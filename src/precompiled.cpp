// The translation unit that owns the precompiled header every library and program reuses
// (zb_torch_pch, CMakeLists.txt): it compiles with their flags and nothing else, so that GCC accepts
// the header wherever those flags are used.

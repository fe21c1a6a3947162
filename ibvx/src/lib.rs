//! IBVX: message passing over verbs and PSM2 (filled by issues 5 and 6).
